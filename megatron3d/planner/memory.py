"""Peak memory of one pipeline rank: what ``nvidia-smi`` would show at the worst moment of a
step.

- states: parameters, gradients (fp32 accumulation buffers included) and optimizer state,
  ``training.memory``'s model on the rank's real ZeRO layout (the start-up report's model);
- activations: what the micro-batches in flight keep for backward, each chunk's bytes per
  micro-batch times how many of its micro-batches the rank's real pipeline program holds at
  once (1F1B: up to PP - rank; interleaved: more on early ranks; GPipe: all). A transformer
  layer costs ``training.activation_memory``'s exact count; the embedding keeps its token ids
  and dropout mask, a norm what a layer's norm keeps, the LM head its input, and the loss one
  fp32 buffer of the rank's logits (the vocab-parallel cross entropy's);
- working: the largest transient of a backward step: a fully recomputed layer's activations,
  or on the last stage the logits (in the activation dtype) beside the loss buffer;
- buffers: the bf16 gradient copies of ``--grad-reduce-in-bf16`` (ZeRO-0/1);
- context and slack: ``hardware.CUDA_CONTEXT_BYTES`` and ``hardware.ALLOCATOR_SLACK``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron3d.accounting.activations import FP32, layer_activation_bytes
from megatron3d.accounting.memory import Buffers, MemoryBytes, state_bytes
from megatron3d.config import ModelConfig, TrainConfig
from megatron3d.pipeline.instructions import Backward, Forward
from megatron3d.pipeline.interleaved import interleaved_1f1b
from megatron3d.pipeline.schedule import schedule_for
from megatron3d.planner.hardware import ALLOCATOR_SLACK, CUDA_CONTEXT_BYTES

TOKEN_ID_BYTES = 8  # int64 ids the embedding lookup keeps
BF16_BYTES = 2


@dataclass(frozen=True)
class RankMemory:
    """Bytes of one rank at its peak, by part."""

    states: MemoryBytes
    activations: int
    working: int
    buffers: int
    context: int
    slack: int

    @property
    def total(self) -> int:
        return (self.states.total + self.activations + self.working + self.buffers
                + self.context + self.slack)


@dataclass(frozen=True)
class Activations:
    """What sizes an activation: the model, and per rank the micro-batch, TP size, sequence
    parallelism, dtype, and the device type whose kernels keep it (norm statistics are fp32
    on CUDA, in the activation dtype on the CPU)."""

    model: ModelConfig
    micro_batch: int
    tp: int
    sequence_parallel: bool
    dtype: torch.dtype
    device_type: str = "cuda"

    def layer(self, recompute: bool = True) -> int:
        """Bytes a transformer layer keeps (``recompute=False``: as if nothing were
        recomputed, what a fully recomputed layer rebuilds in its backward)."""
        return sum(self._terms(recompute).values())

    def chunk(self, names: Sequence[str], padded_vocab: int) -> int:
        """Bytes one micro-batch leaves saved for backward in a chunk of layers ``names``
        (type names of ``gpt_layer_specs``), the loss included when it ends the model. The
        layers outside the blocks keep what the same tensors cost inside a block: a norm what
        a block's norm keeps, the head its input as the QKV projection does, the embedding a
        dropout mask of the residual stream (and its token ids)."""
        plain = self._terms(recompute=False)
        tokens = self.model.seq_length * self.micro_batch
        costs = {"TransformerLayer": self.layer(),
                 "InputEmbedding": plain.get("dropout masks", 0) // 2 + TOKEN_ID_BYTES * tokens,
                 "InputNorm": plain["norms"] // 2, "FinalNorm": plain["norms"] // 2,
                 "OutputEmbedding": plain["qkv input"] + self.loss(padded_vocab)}
        return sum(costs[name] for name in names)

    def loss(self, padded_vocab: int) -> int:
        """The cross entropy's fp32 buffer of this rank's logits [s, b, v/tp] and its fp32
        per-token losses and mask."""
        tokens = self.model.seq_length * self.micro_batch
        return FP32 * tokens * (padded_vocab // self.tp + 1)

    def logits(self, padded_vocab: int) -> int:
        """This rank's logits in the activation dtype (alive while the loss is computed)."""
        return self.dtype.itemsize * self.model.seq_length * self.micro_batch * (
            padded_vocab // self.tp)

    def _terms(self, recompute: bool) -> dict[str, int]:
        """``layer_activation_bytes`` of a block, with the model's recompute or without any."""
        model = self.model
        if not recompute:
            model = dataclasses.replace(model, checkpoint_activations=False,
                                        recompute_granularity=None)
        return layer_activation_bytes(model, self.micro_batch, self.tp, self.sequence_parallel,
                                      self.dtype, self.device_type)


@functools.cache
def in_flight_states(schedule: str, stages: int, rank: int, micro_batches: int,
                     chunks: int) -> frozenset[tuple[int, ...]]:
    """Every distinct count of micro-batches in flight per chunk (forward done, backward not
    yet) that rank ``rank``'s real program passes through. A 1F1B rank (interleaved or not)
    holds a bounded number, reached within its first 2 x PP x chunks micro-batches, after
    which the counts repeat: longer programs are walked that far (``tests/planner``)."""
    if schedule == "1f1b":
        micro_batches = min(micro_batches, 2 * stages * chunks)
    program = (interleaved_1f1b(stages, rank, micro_batches, chunks) if chunks > 1
               else schedule_for(schedule, stages, rank, micro_batches))
    counts = [0] * chunks
    seen = set()
    for step in program:
        if isinstance(step, Forward | Backward):
            counts[step.chunk] += 1 if isinstance(step, Forward) else -1
            seen.add(tuple(counts))
    return frozenset(seen)


def rank_memory(cfg: TrainConfig, buffers: Buffers, dp: int, rank: int, micro_batches: int,
                chunk_names: list[Sequence[str]], padded_vocab: int,
                device_type: str = "cuda") -> RankMemory:
    """Peak bytes of pipeline rank ``rank`` of ``cfg``'s layout, holding the chunks whose
    layer type names are ``chunk_names``, with its ZeRO ``buffers``, ``dp`` data-parallel
    ranks and ``micro_batches`` per step (the largest of the ramp)."""
    parallel, precision = cfg.parallel, cfg.precision
    dtype = getattr(torch, precision.params_dtype_name)
    wire = BF16_BYTES if parallel.grad_reduce_in_bf16 else FP32
    states = state_bytes(buffers, dtype.itemsize, parallel.zero_stage, dp, wire)
    sizes = Activations(cfg.model, cfg.training.micro_batch_size,
                        parallel.tensor_model_parallel_size, parallel.sequence_parallel, dtype,
                        device_type)
    per_chunk = [sizes.chunk(names, padded_vocab) for names in chunk_names]
    states_in_flight = in_flight_states(parallel.pipeline_schedule,
                                        parallel.pipeline_model_parallel_size, rank,
                                        micro_batches, len(chunk_names))
    activations = max(sum(n * b for n, b in zip(counts, per_chunk, strict=True))
                      for counts in states_in_flight)
    rebuilt = sizes.layer(recompute=False) if cfg.model.recompute == "full" else 0
    holds_loss = "OutputEmbedding" in chunk_names[-1]
    working = max(rebuilt, sizes.logits(padded_vocab) if holds_loss else 0)
    copies = 0
    if parallel.grad_reduce_in_bf16 and dp > 1 and parallel.zero_stage < 3:
        copies = BF16_BYTES * (buffers.flat + (buffers.shard if parallel.zero_stage else 0))
    return RankMemory(states=states, activations=activations, working=working, buffers=copies,
                      context=CUDA_CONTEXT_BYTES,
                      slack=int(ALLOCATOR_SLACK * (activations + working)))
