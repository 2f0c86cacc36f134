"""ZeRO-3 at run time: this rank's parameter shard, the slot buffers, and the hooks that
replay the fetch plan.

Construction shards every unit: this rank keeps its 1/DP slice of each unit's flat, padded
parameters (``Shard.local_params``; the optimizer's fp32 master shard sits beside it) and its
fp32 gradient shard, and every parameter becomes a permanent view into its unit's slot. The
stage is built on the meta device and each rank draws only its own ranges
(``mpu/init.fill_flat``), so no rank ever holds more of its stage unsharded than its slots.

The pipeline engine announces each program (``begin``), each finished instruction
(``after``) and the end (``end``); forward pre/post hooks on the stage's layers and a hook on
each layer's output gradient mark the other points of the plan, and each point runs its ops:
all-gather a unit's shards into its slot in ONE collective (or all-reduce the zero-filled slot
with ``allreduce_fetch``: the same values), wait for it, zero a slot's gradients,
reduce-scatter them in ONE collective into the gradient shard (after each micro-batch's
backward, or with ``reshard_after_forward`` False once per step, after the unit's last
backward: its slot sums the micro-batches, as one process does). Nothing is decided per step:
plans are built once per distinct program and cached. How a unit travels (one hop over
every replica, or the node-aware modes' hops within and across nodes) is ``hops.py``'s. On
CUDA the collectives run on the process group's stream and ``wait`` orders the compute
stream after them; the host never blocks on the device.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from megatron3d.config import ParallelConfig
from megatron3d.mpu.init import bind, fill_flat
from megatron3d.mpu.meta import get_meta
from megatron3d.mpu.state import AxisGroup
from megatron3d.pipeline.instructions import Backward
from megatron3d.zero.layout import Counted, FlatLayout
from megatron3d.zero.shard import Shard
from megatron3d.zero.stage3 import plan
from megatron3d.zero.stage3.hops import build_hops
from megatron3d.zero.stage3.slots import Slot
from megatron3d.zero.stage3.units import stage_units


class Zero3:
    def __init__(self, layers: list[nn.Module], dp: AxisGroup, parallel: ParallelConfig,
                 counted: Counted, wire: torch.dtype, device: torch.device,
                 chunk_sizes: tuple[int, ...],
                 nodes: tuple[AxisGroup, AxisGroup] | None = None) -> None:
        """``chunk_sizes``: how many of ``layers`` (in order) each model chunk holds; a
        ``Forward``/``Backward`` of chunk c runs only its layers (interleaving). ``nodes``:
        ``dp`` cut by node, (dp_intra, dp_inter), for the node-aware modes (``hops.py``)."""
        self.dp = dp
        self.chunk_sizes = chunk_sizes
        self.units = stage_units(layers)
        groups = self.units.groups
        self.hops = build_hops(parallel, dp, nodes)
        ways = self.hops.shard_axis.size
        self.layout = FlatLayout([list(g) for g in groups], counted, self.hops.align)
        dtype = groups[0][0].dtype
        self.shard = Shard.sliced(self.layout, self.hops.slice_index, ways, None, dtype, device)
        self.depth = parallel.zero3_prefetch_depth
        self.pinned = self.units.tied if parallel.reshard_after_forward else frozenset(
            range(len(groups)))
        self.accumulate = frozenset() if parallel.reshard_after_forward else self.pinned
        self.slot_of = _assign_slots(len(groups), self.pinned, parallel.live_units)
        self.hops.attach(self.layout, dtype, device, self.slot_of)
        self.slots = self._allocate(dtype, wire, device)
        self._shard_and_bind()
        self._plans: dict[tuple, plan.Plan] = {}
        self._plan: plan.Plan | None = None
        self._cursor = 0
        self._gathers: dict[int, object] = {}
        self._remaining = [0] * len(groups)
        self._advancing: list[Slot] = []  # reductions whose next hop posts at the next point
        self._ops: dict[str, Callable[[int], None]] = {
            plan.GATHER: self._gather, plan.WAIT: self._wait, plan.RELEASE: self._release,
            plan.GRADS: self._zero_grads, plan.REDUCE: self._reduce}
        for j, layer in enumerate(layers):
            layer.register_forward_pre_hook(lambda _m, _x, j=j: self._at(("pre", j, False)))
            layer.register_forward_hook(lambda _m, _x, out, j=j: self._after_forward(j, out))

    # -- construction ---------------------------------------------------------------------

    def _allocate(self, dtype: torch.dtype, wire: torch.dtype,
                  device: torch.device) -> list[Slot]:
        sizes: dict[int, int] = {}
        for unit, slot in self.slot_of.items():
            sizes[slot] = max(sizes.get(slot, 0), self.layout.buckets[unit].numel)
        return [Slot(sizes[s], dtype, wire, device) for s in range(len(sizes))]

    def _shard_and_bind(self) -> None:
        """Draw this rank's slice of each unit into its shard (the parameters were built on
        the meta device: nothing else of them ever exists here); point every parameter into
        its unit's slot, which each gather fills."""
        local = self.shard.local_params
        for unit, bucket in enumerate(self.layout.buckets):
            slot = self.slots[self.slot_of[unit]]
            for p in bucket.params:
                assert p.is_meta, "ZeRO-3 shards a stage built with LayerContext.defer_init"
                offset = self.layout.offset_of(p)
                for lo, hi, at in self.shard.overlaps(offset, offset + p.numel()):
                    fill_flat(get_meta(p).init, p.shape, local[at:at + hi - lo], lo - offset,
                              hi - offset)
                at = offset - bucket.start
                bind(p, slot.params[at:at + p.numel()])
                p.main_grad = slot.grads[at:at + p.numel()].view_as(p)
                p.grad = p.main_grad if p.dtype == torch.float32 else None
                p.register_post_accumulate_grad_hook(lambda q, u=unit: self._on_grad(q, u))

    # -- the pipeline engine's observer ----------------------------------------------------

    def begin(self, program: list) -> None:
        key = tuple(program)
        if key not in self._plans:
            self._plans[key] = plan.build_plan(program, self.units.needs, self.slot_of,
                                               self.pinned, self.depth, self.chunk_sizes,
                                               self.accumulate)
        self._plan, self._cursor = self._plans[key], 0
        self._at(("begin",))

    def after(self, instruction: object) -> None:
        if isinstance(instruction, Backward):
            self._at(("tail",))

    def end(self) -> None:
        self._at(("end",))
        self._advancing.clear()
        for slot in self.slots:
            slot.drain()
        self._plan = None

    # -- points ----------------------------------------------------------------------------

    def _at(self, trigger: tuple) -> None:
        if self._plan is None:
            raise RuntimeError("a ZeRO-3 layer ran outside the pipeline engine; run the "
                               "model through PipelineEngine so its units are gathered")
        point = self._plan.points[self._cursor]
        if point.trigger != trigger:
            raise RuntimeError(f"ZeRO-3 plan out of step: expected {point.trigger}, got "
                               f"{trigger}; this is a bug")
        self._cursor += 1
        for slot in self._advancing:
            slot.advance()
        self._advancing.clear()
        for op in point.ops:
            self._ops[op.kind](op.unit)

    def _after_forward(self, j: int, out: torch.Tensor) -> None:
        self._at(("post", j))
        if torch.is_grad_enabled() and out.requires_grad:
            out.register_hook(lambda _grad: self._at(("pre", j, True)))

    def _on_grad(self, param: nn.Parameter, unit: int) -> None:
        if param.grad is not param.main_grad:  # low precision: accumulate in fp32
            param.main_grad.add_(param.grad)
            param.grad = None
        self._remaining[unit] -= 1

    # -- ops -------------------------------------------------------------------------------

    def _gather(self, unit: int) -> None:
        slot = self.slots[self.slot_of[unit]]
        assert slot.occupant is None, f"unit {unit}: slot still holds unit {slot.occupant}"
        slot.occupant = unit
        piece = self.shard.pieces[unit]
        mine = self.shard.local_params[piece.local:piece.local + piece.end - piece.start]
        full = slot.params[:self.layout.buckets[unit].numel]
        self._gathers[unit] = self.hops.gather(unit, full, mine)

    def _wait(self, unit: int) -> None:
        work = self._gathers.pop(unit)
        if work is not None:
            work.wait()

    def _release(self, unit: int) -> None:
        self.slots[self.slot_of[unit]].occupant = None

    def _zero_grads(self, unit: int) -> None:
        slot = self.slots[self.slot_of[unit]]
        slot.drain()
        slot.grads[:self.layout.buckets[unit].numel].zero_()
        self._remaining[unit] = len(self.units.groups[unit]) * self._plan.passes[unit]

    def _reduce(self, unit: int) -> None:
        if self._remaining[unit] != 0:
            raise RuntimeError(f"ZeRO-3 unit {unit} is reduced before all its gradients "
                               "arrived; this is a bug")
        piece = self.shard.pieces[unit]
        n = piece.end - piece.start
        slot = self.slots[self.slot_of[unit]]
        slot.reduce_scatter(unit, self.layout.buckets[unit].numel,
                            self.shard.grads[piece.local:piece.local + n], self.hops)
        if self.hops.levels > 1:
            self._advancing.append(slot)

    # -- the data-parallel interface (zero/factory.py) ------------------------------------

    @property
    def observer(self) -> Zero3:
        return self

    @property
    def norm_axis(self) -> AxisGroup:
        """The ranks whose shards together hold the stage once (the grad norm's DP axis)."""
        return self.hops.shard_axis

    @property
    def replica_axis(self) -> AxisGroup | None:
        """The ranks holding this rank's shard too (hybrid: the other nodes), or None."""
        return self.hops.replica_axis

    @property
    def secondary_numel(self) -> int:
        """Elements of the secondary shard's buffer (0 without one)."""
        return self.hops.secondary_numel

    def gather_params(self) -> None:
        """Nothing is gathered after the step: units are gathered from the shards when they
        next run; a kept copy of the weights (the secondary shard) is out of date."""
        self.hops.stale()

    def before_last_backward(self, chunk: int) -> None:
        """Nothing: the plan says when each unit's gradients are reduce-scattered."""

    def finish(self) -> None:
        """The program's end already completed every reduction; hybrid sums the nodes'."""
        self.hops.finish(self.shard.grads)

    def flush(self) -> None:
        """Nothing in flight between programs."""

    def values_of(self, params: list[nn.Parameter]) -> list[tuple[nn.Parameter, torch.Tensor]]:
        return self.shard.values_of(params)

    # -- outside the hot path --------------------------------------------------------------

    def materialize(self, fn: Callable[[list[nn.Parameter]], None]) -> None:
        """Call ``fn`` with each unit's parameters gathered (checks, tests, exports)."""
        for unit, group in enumerate(self.units.groups):
            if self.slots[self.slot_of[unit]].occupant is not None:
                raise RuntimeError("materialize() needs every unit released (between steps)")
            self._gather(unit)
            self._wait(unit)
            fn(list(group))
            self._release(unit)

    def resident_bytes(self) -> tuple[int, int]:
        """(parameter bytes, gradient bytes) held now: shards, slot buffers and the
        secondary shard."""
        shard = self.shard.local_params
        params = (shard.nbytes + self.hops.secondary_numel * shard.element_size()
                  + self.hops.wire_bytes + sum(s.params.nbytes for s in self.slots))
        grads = self.shard.grads.nbytes + sum(s.nbytes() - s.params.nbytes for s in self.slots)
        return params, grads


def _assign_slots(num_units: int, pinned: frozenset[int], live: int) -> dict[int, int]:
    """Pooled unit k (in layer order) -> slot k mod ``live``; each pinned unit its own."""
    pooled = [u for u in range(num_units) if u not in pinned]
    pool = min(live, len(pooled))
    slot_of = {u: k % pool for k, u in enumerate(pooled)}
    for k, u in enumerate(sorted(pinned)):
        slot_of[u] = pool + k
    return slot_of
