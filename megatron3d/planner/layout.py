"""One candidate layout, the training config that runs it, and where its layers go.

A ``Layout`` is every choice the planner makes: TP, PP (DP follows from the world size),
micro-batch size, ZeRO stage, recompute, the pipeline partition method and the model chunks
per pipeline rank. ``apply`` writes it into the user's ``TrainConfig``, so validation, the
memory model and the time model all read the same config ``pretrain_gpt.py`` would run.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from megatron3d.config import TrainConfig
from megatron3d.validation import layer_table, stage_bounds

RECOMPUTE = ("none", "selective", "full")


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
            num_layers_per_virtual_pipeline_stage=None)
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
        return " ".join(words)


@dataclass(frozen=True)
class Placement:
    """The layers of each pipeline rank: ``spans[r][c]`` is rank r's chunk c as a range of
    ``gpt_layer_specs`` (virtual stage c * PP + r), ``names`` every layer's type name."""

    names: tuple[str, ...]
    spans: tuple[tuple[tuple[int, int], ...], ...]

    def chunk_names(self, rank: int) -> list[tuple[str, ...]]:
        return [self.names[a:b] for a, b in self.spans[rank]]

    @property
    def virtual_stages(self) -> list[tuple[str, ...]]:
        """Type names of every virtual stage, in pipeline order."""
        ranks, chunks = len(self.spans), len(self.spans[0])
        return [self.names[slice(*self.spans[r][c])] for c in range(chunks) for r in range(ranks)]


def placement(cfg: TrainConfig) -> Placement:
    """Where ``cfg``'s layers go: partitioned by the partitioner on the real layer list, as
    ``build_engine`` does (``cfg`` must have passed validation)."""
    parallel = cfg.parallel
    p, v = parallel.pipeline_model_parallel_size, parallel.virtual_size(cfg.model.num_layers)
    stages = list(itertools.pairwise(stage_bounds(cfg.model, p, parallel.pp_partition_method, v)))
    names = layer_table(cfg.model)[0]
    return Placement(names, tuple(tuple(stages[c * p + r] for c in range(v)) for r in range(p)))
