"""Per-rank memory of parameters, gradients and optimizer state: analytic and measured.

The analytic numbers follow the ZeRO paper's accounting for this rank's parameters P (its
pipeline stage and TP slice): parameters P x (2 or 4) bytes, fp32 gradient buffer 4P, and
optimizer state (fp32 master copy when the model is bf16/fp16, plus two fp32 Adam moments):
12P or 8P bytes, divided by DP under ZeRO-1 (which also keeps a 4P/DP buffer of its
reduce-scattered gradients). ZeRO-3 divides parameters, gradients and optimizer state by DP
and adds its live-unit buffers: L elements of slots holding (2 or 4) + 4 + 4/DP bytes each
(gathered parameters, their fp32 gradients, the reduce-scatter output). Measured numbers read
the real buffers, so padding shows.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import torch

from megatron3d import device as devices
from megatron3d.config import TrainConfig
from megatron3d.errors import ConfigError
from megatron3d.model.context import LayerContext
from megatron3d.model.gpt import gpt_layer_specs, layer_param_counts
from megatron3d.mpu.state import AxisGroup
from megatron3d.optim.mixed_precision import MixedPrecisionOptimizer
from megatron3d.pipeline.partition import partition_layers
from megatron3d.zero.factory import DataParallel


@dataclass(frozen=True)
class MemoryBytes:
    params: int
    grads: int
    optimizer_state: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer_state

    def lines(self, label: str) -> list[str]:
        gib = 2.0 ** 30
        return [f"  {label:<9} parameters {self.params:>14,} B ({self.params / gib:.3f} GiB)"
                f" | gradients {self.grads:>14,} B | optimizer state "
                f"{self.optimizer_state:>14,} B ({self.optimizer_state / gib:.3f} GiB)"]


def analytic(num_params: int, param_bytes: int, zero_stage: int, dp: int,
             live_numel: int = 0) -> MemoryBytes:
    """``live_numel``: elements of ZeRO-3's slot buffers (``live_numel()``)."""
    master = 4 * num_params if param_bytes < 4 else 0
    optimizer_state = (master + 8 * num_params) // (dp if zero_stage else 1)
    if zero_stage == 3:
        return MemoryBytes(params=param_bytes * (num_params // dp + live_numel),
                           grads=4 * num_params // dp + live_numel * (4 + 4 // dp),
                           optimizer_state=optimizer_state)
    shard_grads = 4 * num_params // dp if zero_stage == 1 else 0
    return MemoryBytes(params=param_bytes * num_params, grads=4 * num_params + shard_grads,
                       optimizer_state=optimizer_state)


def live_numel(data_parallel: DataParallel) -> int:
    """Elements of the buffers gathered ZeRO-3 units live in (0 for ZeRO-0/1)."""
    return sum(slot.params.numel() for slot in getattr(data_parallel, "slots", ()))


def measured(optimizer: MixedPrecisionOptimizer, data_parallel: DataParallel) -> MemoryBytes:
    """What this rank holds now (Adam's moments exist after the first step)."""
    params, grads = data_parallel.resident_bytes()
    return MemoryBytes(params=params, grads=grads, optimizer_state=optimizer.state_bytes())


def report(title: str, expected: MemoryBytes, actual: MemoryBytes | None = None) -> str:
    lines = [title, *expected.lines("analytic")]
    if actual is not None:
        lines += actual.lines("measured")
        allocated = devices.allocated_bytes()
        if allocated is not None:
            lines.append(f"  device allocated {allocated:,} B")
    return "\n".join(lines)


def fullest_rank_lower_bound(cfg: TrainConfig, world_size: int) -> int:
    """Bytes of parameters, gradients and optimizer state on the fullest rank, at least: the
    largest pipeline stage (partitioned as training will) split evenly over TP. Norms and
    biases are really replicated and activations come on top, so the truth is higher; with
    real data the vocabulary is not known yet and counts as one token."""
    model = cfg.model if cfg.model.vocab_size else dataclasses.replace(cfg.model, vocab_size=1)
    ctx = LayerContext(model, AxisGroup.single(), cfg.training.seed)
    names = [spec.type_name for spec in gpt_layer_specs(ctx)]
    counts = layer_param_counts(ctx)
    parallel = cfg.parallel
    bounds = partition_layers(names, counts, parallel.pipeline_model_parallel_size,
                              parallel.pp_partition_method)
    shared = cfg.model.tie_embeddings and bounds[-2] == 0  # one stage: one tied tensor
    stage = max(sum(counts[a:b]) for a, b in itertools.pairwise(bounds)) - (
        counts[-1] if shared else 0)
    param_bytes = getattr(torch, cfg.precision.params_dtype_name).itemsize
    return analytic(stage // parallel.tensor_model_parallel_size, param_bytes,
                    parallel.zero_stage, parallel.data_parallel_size(world_size)).total


def check_fits(cfg: TrainConfig, world_size: int, capacity: int) -> None:
    """``ConfigError`` before any work when the model states alone exceed a rank's
    ``capacity`` bytes (its device memory), instead of an out-of-memory error later."""
    need = fullest_rank_lower_bound(cfg, world_size)
    if need > capacity:
        gib = 2.0**30
        raise ConfigError(
            f"the model does not fit: its parameters, gradients and optimizer state alone need "
            f"at least {need / gib:.1f} GiB on the fullest rank, which has {capacity / gib:.1f}"
            " GiB: raise --tensor-model-parallel-size or --pipeline-model-parallel-size, use "
            "--zero-stage 1 or 3 with more data-parallel ranks, or --bf16, or shrink the model")
