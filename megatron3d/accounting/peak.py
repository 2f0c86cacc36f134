"""Peak device memory of one pipeline rank, phase by phase: what ``nvidia-smi`` would show at
the worst moment of building the run, of a training step, of an evaluation and of a
checkpoint save. The planner ranks layouts by it and ``fit.check_fits`` refuses a run with
it, so both read the same numbers.

Each phase is a list of named parts, the tensors alive at its worst moment, plus what the
device holds besides tensors (``overheads.py``: CUDA context, NCCL communicators, and the
caching allocator's reserve on top of the tensors):

- build: every state but Adam's moments (allocated at the first step): the stage is built
  on the meta device and each rank draws straight into its ZeRO buffers (``mpu/init.py``),
  so nothing else of it ever exists;
- train: every state (``memory.state_bytes``), the micro-batches in flight at most
  (``in_flight.py``) and the largest working set of a backward (``transients.py``: a
  layer's, the input embedding's weight gradient, or the LM head's logits and weight
  gradient), plus the pipeline messages. The optimizer step that follows adds no scratch
  worth counting: torch's fused AdamW updates in one kernel, the gradient norm is a scalar
  per tensor, clipping and the master-to-parameter copy are in place, ZeRO-1's all-gather
  writes the flat buffer in place, and the activations are gone by then;
- evaluate: every state and an evaluation forward's working set (nothing kept), plus the
  pipeline messages;
- save: every state and the save's staging (``overheads.SAVE_STAGING_BYTES``).

Every phase is reported; the peak is over those the run goes through (``phases_run``: no
save without ``--save``).

Buffers held for the whole run are in every phase: the reducer's bf16 gradient copies
(``--grad-reduce-in-bf16``), the ALiBi bias and the rotary tables.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron3d.accounting import overheads, transients
from megatron3d.accounting.in_flight import Activations, in_flight_states, peak_in_flight
from megatron3d.accounting.memory import (
    BF16,
    FP32,
    Buffers,
    MemoryBytes,
    moment_bytes,
    state_bytes,
    wire_bytes,
)
from megatron3d.config import TrainConfig

PHASES = ("build", "train", "evaluate", "save")
STATE_PARTS = ("parameters", "gradients", "optimizer state")


@dataclass(frozen=True)
class PhaseMemory:
    """One phase's worst moment on one rank: ``parts`` are the tensors alive, by name (bytes);
    ``context`` and ``nccl`` what the device holds besides tensors."""

    phase: str
    parts: tuple[tuple[str, int], ...]
    context: int
    nccl: int
    device_type: str

    def part(self, name: str) -> int:
        return dict(self.parts).get(name, 0)

    def with_parts(self, changes: dict[str, int]) -> PhaseMemory:
        """The same phase with some parts replaced (what-ifs: another optimizer's states)."""
        return dataclasses.replace(self, parts=tuple({**dict(self.parts), **changes}.items()))

    @functools.cached_property
    def allocated(self) -> int:
        return sum(size for _, size in self.parts)

    @property
    def reserve(self) -> int:
        """The caching allocator's fragmentation on top of the tensors."""
        return overheads.reserved(self.allocated, self.device_type) - self.allocated

    @functools.cached_property
    def total(self) -> int:
        return self.allocated + self.reserve + self.context + self.nccl


@dataclass(frozen=True)
class RankMemory:
    """Every phase of one pipeline rank, ``runs`` the ones its run goes through (the peak is
    theirs), and its steady states (parameters, gradients and optimizer state after the
    first step)."""

    phases: tuple[PhaseMemory, ...]
    runs: tuple[str, ...]
    states: MemoryBytes

    def phase(self, name: str) -> PhaseMemory:
        return next(p for p in self.phases if p.phase == name)

    @functools.cached_property
    def peak(self) -> PhaseMemory:
        return max((p for p in self.phases if p.phase in self.runs), key=lambda p: p.total)

    @property
    def total(self) -> int:
        return self.peak.total


def rank_memory(cfg: TrainConfig, buffers: Buffers, dp: int, rank: int, micro_batches: int,
                chunk_names: list[Sequence[str]], padded_vocab: int,
                device_type: str = "cuda") -> RankMemory:
    """Every phase of pipeline rank ``rank`` of ``cfg``'s layout, holding the chunks whose
    layer type names are ``chunk_names``, with its ZeRO ``buffers`` (sharded over the DP x
    CP replicas), ``dp`` data-parallel ranks and ``micro_batches`` per step (the largest of
    the ramp). Under context parallelism each rank holds s/C tokens of every sequence."""
    parallel, model = cfg.parallel, cfg.model
    tp, pp, zero = (parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size,
                    parallel.zero_stage)
    cp = parallel.context_parallel_size
    dtype = getattr(torch, cfg.precision.params_dtype_name)
    e = dtype.itemsize
    states = state_bytes(buffers, e, zero, dp * cp,
                         BF16 if parallel.grad_reduce_in_bf16 else FP32)
    sizes = Activations(model, cfg.training.micro_batch_size, tp, parallel.sequence_parallel,
                        dtype, device_type, cp, parallel.cp_comm_type)
    names = [name for chunk in chunk_names for name in chunk]
    held = transients.model_buffers(sizes, names)
    kept = {"reducer bf16 copies": wire_bytes(buffers, zero, dp * cp,
                                              parallel.grad_reduce_in_bf16), **held}
    steady = {**dict(zip(STATE_PARTS, (states.params, states.grads, states.optimizer_state),
                         strict=True)), **kept}
    messages = {"pipeline messages": transients.pipeline_messages(sizes, pp)}
    per_chunk = [sizes.chunk(chunk, padded_vocab) for chunk in chunk_names]
    in_flight = peak_in_flight(per_chunk, in_flight_states(
        parallel.pipeline_schedule, pp, rank, micro_batches, len(chunk_names)))
    parts = {
        "build": {"states before the first step": states.total - moment_bytes(buffers),
                  **kept},
        "train": {**steady, "activations in flight": in_flight,
                  "backward working set": transients.backward_working_set(
                      sizes, names, padded_vocab), **messages},
        "evaluate": {**steady, "forward working set": transients.forward_working_set(
            sizes, names, padded_vocab), **messages},
        "save": {**steady, "save staging": overheads.SAVE_STAGING_BYTES},
    }
    on_cuda = device_type == "cuda"
    nccl = overheads.nccl_bytes(overheads.nccl_groups(tp, pp, dp, model.tie_embeddings, rank,
                                                      cp))
    return RankMemory(tuple(
        PhaseMemory(phase, tuple((name, size) for name, size in parts[phase].items() if size),
                    overheads.CUDA_CONTEXT_BYTES if on_cuda else 0, nccl if on_cuda else 0,
                    device_type) for phase in PHASES), phases_run(cfg), states)


def phases_run(cfg: TrainConfig) -> tuple[str, ...]:
    """The phases ``cfg``'s run goes through: always the build, training unless
    ``--skip-train``, evaluation with ``--eval-iters`` > 0, a save with ``--save``."""
    runs = {"build": True, "train": not cfg.training.skip_train,
            "evaluate": cfg.training.eval_iters > 0, "save": bool(cfg.checkpoint.save)}
    return tuple(phase for phase in PHASES if runs[phase])
