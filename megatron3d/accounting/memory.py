"""Per-rank memory of parameters, gradients and optimizer state: the states part of the one
memory model the topology planner, the start-up report and the up-front fit check share
(``peak.py`` adds the rest, phase by phase), and what a rank really holds.

``state_bytes`` turns a rank's buffer sizes (``Buffers``, in elements) into bytes:

- ZeRO-0/1: the flat parameter buffer (model dtype) and the flat fp32 gradient buffer, both
  of the padded layout (each bucket padded to a multiple of DP under ZeRO-1), and under
  ZeRO-1 the fp32 buffer of this rank's reduce-scattered slice;
- ZeRO-3: this rank's 1/DP shard of every unit (model dtype, and its fp32 gradients) and the
  slot buffers gathered units live in: per slot element its parameter, its fp32 gradient
  and, with a bf16 wire, a bf16 copy (the reduce-scatter is in place: no output buffer);
  with the secondary shard (``--zero3-secondary-shard node``) its model-dtype copy of 1/k of
  the stage (k ranks per node); hybrid sharding (``--zero3-shard-group node``) shards over
  the node's k replicas, not all D (planned from flat buffers by ``nodes.node_buffers``);
- optimizer state: the fp32 master copy of the slice a rank updates (bf16/fp16 models,
  padding included) and Adam's two fp32 moments of the real elements in it.

The sizes come from the real layout (``planned_buffers``: the rank's stage and its ZeRO
buffers are built on the meta device by the framework's own code, so every padding, bucket
and slot is the run's and nothing is allocated), or from totals alone (``analytic``: the
start-up report knows a rank's parameter count, not its padding).
``measured`` reads the real buffers of a run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron3d import device as devices
from megatron3d.config import TrainConfig
from megatron3d.model.context import LayerContext
from megatron3d.model.gpt import gpt_layer_specs
from megatron3d.mpu.state import AxisGroup
from megatron3d.optim.mixed_precision import MixedPrecisionOptimizer
from megatron3d.pipeline.spec import VirtualStages, build_chunks
from megatron3d.zero.factory import DataParallel, build_data_parallel

FP32 = 4
BF16 = 2
ADAM_MOMENTS = 2  # exp_avg and exp_avg_sq, fp32, per updated element


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


@dataclass(frozen=True)
class Buffers:
    """Element counts of one rank's ZeRO buffers.

    flat: the padded flat layout of the rank's parameters; shard: the elements it updates
    (its slices under ZeRO-1/3, padding included; ``flat`` without ZeRO); updated: the real
    parameter elements among them; slots: ZeRO-3's slot elements (0 otherwise); secondary:
    the elements of ZeRO-3's secondary shard (0 without one).
    """

    flat: int
    shard: int
    updated: int
    slots: int = 0
    secondary: int = 0


def state_bytes(buffers: Buffers, param_bytes: int, zero_stage: int, dp: int,
                wire_bytes: int = FP32) -> MemoryBytes:
    """Bytes of ``buffers`` (see the module docstring); ``wire_bytes``: 2 when data-parallel
    gradients travel in bf16 (``--grad-reduce-in-bf16``)."""
    master = FP32 * buffers.shard if param_bytes < FP32 else 0
    optimizer = master + ADAM_MOMENTS * FP32 * buffers.updated
    if zero_stage == 3:
        slots = buffers.slots
        copy = wire_bytes * slots if wire_bytes < FP32 else 0
        return MemoryBytes(params=param_bytes * (buffers.shard + slots + buffers.secondary),
                           grads=FP32 * (buffers.shard + slots) + copy,
                           optimizer_state=optimizer)
    sliced = FP32 * buffers.shard if zero_stage == 1 else 0
    return MemoryBytes(params=param_bytes * buffers.flat, grads=FP32 * buffers.flat + sliced,
                       optimizer_state=optimizer)


def moment_bytes(buffers: Buffers) -> int:
    """Adam's two fp32 moments, which the optimizer allocates at its first step."""
    return ADAM_MOMENTS * FP32 * buffers.updated


def wire_bytes(buffers: Buffers, zero_stage: int, dp: int, grad_reduce_in_bf16: bool) -> int:
    """The reducer's bf16 copies of the flat gradients and of its ZeRO-1 slice, allocated at
    start with ``--grad-reduce-in-bf16`` (ZeRO-0/1; ZeRO-3's are in its slots)."""
    if not grad_reduce_in_bf16 or dp == 1 or zero_stage == 3:
        return 0
    return BF16 * (buffers.flat + (buffers.shard if zero_stage else 0))


def analytic(num_params: int, param_bytes: int, zero_stage: int, dp: int,
             live_numel: int = 0, secondary_numel: int = 0) -> MemoryBytes:
    """``state_bytes`` from a rank's parameter count alone (no padding known); ``dp``: the
    ranks the states are sharded over; ``live_numel``: elements of ZeRO-3's slot buffers
    (``live_numel()``); ``secondary_numel``: of its secondary shard."""
    shard = num_params // dp if zero_stage else num_params
    return state_bytes(Buffers(flat=num_params, shard=shard, updated=shard, slots=live_numel,
                               secondary=secondary_numel), param_bytes, zero_stage, dp)


def expected(params: list, zero_stage: int, data_parallel: DataParallel) -> MemoryBytes:
    """``analytic`` for a run's own stage ``params`` and data-parallel object: the states
    sharded over its norm axis (hybrid ZeRO-3: the node's replicas), its slots and secondary
    shard."""
    axis = data_parallel.norm_axis
    return analytic(sum(p.numel() for p in params), params[0].element_size(), zero_stage,
                    axis.size if axis is not None else 1, live_numel(data_parallel),
                    data_parallel.secondary_numel)


def planned_buffers(cfg: TrainConfig, tp: int, dp: int,
                    spans: list[tuple[int, int]]) -> Buffers:
    """The ZeRO buffers of a rank holding the layers ``spans`` (its model chunks, ranges of
    ``gpt_layer_specs``) at tensor-parallel size ``tp`` and data-parallel size ``dp``, as
    ``build_trainer`` lays them out, built on the meta device."""
    meta = torch.device("meta")
    ctx = LayerContext(cfg.model, _axis(tp), cfg.training.seed,
                       getattr(torch, cfg.precision.params_dtype_name), meta,
                       sequence_parallel=cfg.parallel.sequence_parallel)  # nothing is drawn
    chunks = build_chunks(gpt_layer_specs(ctx), spans)
    stage = chunks[0] if len(chunks) == 1 else VirtualStages(chunks)
    data_parallel = build_data_parallel(
        list(stage.parameters()), list(stage.layers), _axis(dp), cfg.parallel,
        lambda _param: True, meta, tuple(len(chunk.layers) for chunk in chunks))
    shard = data_parallel.shard
    updated = sum(end - start for _, start, end, _ in shard.segment_parts())
    return Buffers(flat=shard.layout.numel, shard=shard.numel, updated=updated,
                   slots=live_numel(data_parallel), secondary=data_parallel.secondary_numel)


def _axis(size: int) -> AxisGroup:
    """Rank 0's view of an axis of ``size`` ranks, without processes (every rank of an axis
    holds the same sizes: layouts split evenly)."""
    return AxisGroup(None, 0, size, tuple(range(size)))


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
