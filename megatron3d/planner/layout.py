"""One candidate layout and the training config that runs it.

A ``Layout`` is every choice the planner makes: TP, PP, CP (DP follows from the world size),
micro-batch size, ZeRO stage (and ZeRO-3's use of nodes), recompute, the pipeline partition
method, the model chunks per pipeline rank and sequence parallelism. ``apply`` writes it into
the user's ``TrainConfig``, so validation, the memory model and the time model all read the
same config ``pretrain_gpt.py`` would run; ``accounting/placement.py`` says where its layers
go.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron3d.config import TrainConfig

RECOMPUTE = ("none", "selective", "full")
ZERO3_MODES = ("flat", "hybrid", "secondary")
"""ZeRO-3 over every replica, sharded in the node and replicated across nodes
(``--zero3-shard-group node``), or with a node-local secondary shard
(``--zero3-secondary-shard node``)."""


@dataclass(frozen=True, order=True)
class Layout:
    tp: int
    pp: int
    dp: int
    micro_batch_size: int
    zero_stage: int
    recompute: str  # one of RECOMPUTE
    partition_method: str
    virtual: int = 1  # model chunks per pipeline rank (interleaved 1F1B when > 1)
    sequence_parallel: bool = False  # only with TP > 1
    cp: int = 1  # context-parallel size: ranks splitting each sequence
    cp_comm_type: str = "p2p"  # their exchange (the user's, not searched)
    zero3_mode: str = "flat"  # one of ZERO3_MODES (ZeRO-3 only)

    @property
    def replicas(self) -> int:
        """Ranks holding the same weights, over which ZeRO shards: DP x CP."""
        return self.dp * self.cp

    @property
    def checkpoint_activations(self) -> bool:
        return self.recompute == "full"

    def apply(self, cfg: TrainConfig) -> TrainConfig:
        """``cfg`` run with this layout (--checkpoint-activations is spelled as
        --recompute-granularity full)."""
        parallel = dataclasses.replace(
            cfg.parallel, tensor_model_parallel_size=self.tp, pipeline_model_parallel_size=self.pp,
            zero_stage=self.zero_stage, pp_partition_method=self.partition_method,
            virtual_pipeline_model_parallel_size=self.virtual if self.virtual > 1 else None,
            num_layers_per_virtual_pipeline_stage=None, sequence_parallel=self.sequence_parallel,
            context_parallel_size=self.cp, cp_comm_type=self.cp_comm_type,
            zero3_shard_group="node" if self.zero3_mode == "hybrid" else "world",
            zero3_secondary_shard="node" if self.zero3_mode == "secondary" else "none")
        model = dataclasses.replace(
            cfg.model, checkpoint_activations=False,
            recompute_granularity=None if self.recompute == "none" else self.recompute)
        training = dataclasses.replace(cfg.training, micro_batch_size=self.micro_batch_size)
        return dataclasses.replace(cfg, parallel=parallel, model=model, training=training)

    def flags(self) -> str:
        """The pretrain_gpt.py flags that choose this layout."""
        words = [f"--tensor-model-parallel-size {self.tp}",
                 f"--pipeline-model-parallel-size {self.pp}",
                 f"--micro-batch-size {self.micro_batch_size}", f"--zero-stage {self.zero_stage}",
                 f"--pp-partition-method '{self.partition_method}'"]
        if self.recompute != "none":
            words.append(f"--recompute-granularity {self.recompute}")
        if self.virtual > 1:
            words.append(f"--virtual-pipeline-model-parallel-size {self.virtual}")
        if self.sequence_parallel:
            words.append("--sequence-parallel")
        if self.cp > 1:
            words.append(f"--context-parallel-size {self.cp} --cp-comm-type {self.cp_comm_type}")
        words += {"flat": [], "hybrid": ["--zero3-shard-group node"],
                  "secondary": ["--zero3-secondary-shard node"]}[self.zero3_mode]
        return " ".join(words)
