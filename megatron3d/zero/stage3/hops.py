"""How a ZeRO-3 unit travels in each sharding mode: its gather from the shards and its
gradients' reduction, hop by hop. The plan (``plan.py``) says when; this says how.

D = n x k weight replicas (``dp_cp``): n nodes of k; intra rank l (``dp_intra``), inter rank m
(``dp_inter``, this rank's counterparts on the other nodes, in node order).

- flat (``--zero3-shard-group world``): this rank's primary shard is slice ``dp.rank`` of D
  of every unit; one all-gather and one reduce-scatter over every replica.
- hybrid (``--zero3-shard-group node``): slice l of k; gathers and reduce-scatters stay in
  the node; the shard gradients accumulate over the step and ONE all-reduce over dp_inter
  sums the nodes' (``finish``), so the optimizer state is replicated across nodes and every
  replica takes the same step.
- secondary (``--zero3-secondary-shard node``, ZeRO++ hpZ): slice s = l*n + m of D. In that
  order the dp_inter all-gather of the primary slices is exactly chunk l of N/k elements,
  the secondary shard, kept in a model-dtype buffer; the dp_intra all-gather of the
  secondaries is the unit. A unit's first gather after the weights changed
  (``stale``: after the optimizer step, a load, at start) takes both hops; every other one
  only the intra hop. Gradients go in two levels: reduce-scatter over dp_intra (N -> chunk
  l, in place), then of that chunk over dp_inter (-> sub-chunk m = slice l*n + m, in place).

Every hop is one call site (``_gather_hop``, ``_reduce_hop``, ``_sum_hop``), which a
quantized variant replaces (``zero/quantize.py``, blockwise int8): ``--zero3-quantize-weights``
the gathers reading the primary shards (flat: every gather; secondary: the inter hop;
hybrid: its gathers), ``--zero3-quantize-grads`` the gradient hop crossing nodes (flat: the
reduce-scatter; secondary: the inter level; hybrid: the per-step sum, as a quantized
reduce-scatter then a quantized all-gather of the sums, which every replica decodes alike).
A quantized collective's wire holds its bytes until it is waited for, so each slot has its
own wires (sized at start for the slot's largest unit): a slot has one gather and one
reduction in flight at most. A second hop waits for the first (``Chain``): a gather's at the
plan's WAIT point (its first hop is the slow, cross-node one, overlapped with computation
until then), a reduction's at the next point (its first hop is the node's). Every gradient
is divided by D before its first hop.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron3d.config import ParallelConfig
from megatron3d.mpu import comm
from megatron3d.mpu.state import AxisGroup
from megatron3d.zero import quantize
from megatron3d.zero.layout import FlatLayout
from megatron3d.zero.quantize import QuantizedWire

Work = comm.Work | None


class Chain:
    """Two collectives, the second posted once the first completed; ``wait`` finishes both."""

    def __init__(self, first: Work, second: Callable[[], Work]) -> None:
        self._work: Work = first
        self._second: Callable[[], Work] | None = second

    def advance(self) -> None:
        """Wait for the first hop and post the second (nothing once it is posted)."""
        if self._second is None:
            return
        if self._work is not None:
            self._work.wait()
        self._work, self._second = self._second(), None

    def wait(self) -> None:
        self.advance()
        if self._work is not None:
            self._work.wait()
            self._work = None


class Flat:
    """One hop over every replica each way (today's ZeRO-3)."""

    levels = 1  # hops of a reduction

    def __init__(self, dp: AxisGroup, intra: AxisGroup, inter: AxisGroup,
                 parallel: ParallelConfig) -> None:
        self.dp, self.intra, self.inter = dp, intra, inter
        self.allreduce_fetch = parallel.zero3_allreduce_fetch
        self.quantize_weights = parallel.zero3_quantize_weights
        self.quantize_grads = parallel.zero3_quantize_grads
        self.shard_axis = dp  # the ranks the primary shards split a unit over
        self.replica_axis: AxisGroup | None = None  # ranks holding this rank's shard too
        self.secondary_numel = 0  # elements of the kept secondary shard
        self.wire_bytes = 0  # of the quantized collectives' wires
        self._slot_of: dict[int, int] = {}
        self._weight_wires: dict[int, QuantizedWire] = {}  # slot -> its gathers' wire
        self._grad_wires: dict[int, QuantizedWire] = {}  # slot -> its reductions' wire

    @property
    def align(self) -> int:
        """What every unit's padded size divides by."""
        return self.dp.size

    @property
    def slice_index(self) -> int:
        """Which of the ``shard_axis.size`` slices of each unit this rank's primary is."""
        return self.dp.rank

    def attach(self, layout: FlatLayout, dtype: torch.dtype, device: torch.device,
               slot_of: dict[int, int]) -> None:
        """Allocate what the mode keeps beside the shard: the quantized collectives' wires
        of each slot (``slot_of``: unit -> slot), the secondary shard."""
        self._slot_of = slot_of
        largest: dict[int, int] = {}
        for unit, slot in slot_of.items():
            largest[slot] = max(largest.get(slot, 0), layout.buckets[unit].numel)
        for slot, numel in largest.items():
            if self.quantize_weights:
                self._weight_wires[slot] = self._wire(*self._weighed(numel), device)
            graded = self._graded(numel)
            if self.quantize_grads and graded is not None:
                self._grad_wires[slot] = self._wire(*graded, device)

    def _weighed(self, numel: int) -> tuple[int, int]:
        """(elements, ranks) of the quantized gather of a unit of ``numel``."""
        return numel, self.dp.size

    def _graded(self, numel: int) -> tuple[int, int] | None:
        """(elements, ranks) of the quantized reduction of a unit of ``numel`` (None: a
        unit's reduction does not cross nodes)."""
        return numel, self.dp.size

    def _wire(self, numel: int, ranks: int, device: torch.device) -> QuantizedWire:
        wire = QuantizedWire(numel, ranks, device)
        self.wire_bytes += sum(t.nbytes for t in (wire.sent, wire.received, wire.chunk))
        return wire

    def stale(self) -> None:
        """The primary shards changed (optimizer step, load)."""

    def gather(self, unit: int, full: torch.Tensor, mine: torch.Tensor) -> Work:
        """Begin gathering unit ``unit`` into ``full`` from this rank's primary ``mine``."""
        return self._gather_hop(full, mine, self.dp, ("unit", unit),
                                self._weight_wires.get(self._slot_of[unit]))

    def reduce(self, unit: int, grads: torch.Tensor) -> tuple[Work, torch.Tensor]:
        """Begin summing a unit's gradients (already divided by D; overwritten); returns
        the work and the view of ``grads`` where this rank's primary slice of the sum lands."""
        return self._reduce_in_place(grads, self.dp, ("unit", unit),
                                     self._grad_wires.get(self._slot_of[unit]))

    def finish(self, shard_grads: torch.Tensor) -> None:
        """After the step's last reduction, before the optimizer."""

    # -- the hops ---------------------------------------------------------------------------

    def _gather_hop(self, out: torch.Tensor, mine: torch.Tensor, axis: AxisGroup,
                    tag: object, wire: QuantizedWire | None = None) -> Work:
        if wire is not None:
            return quantize.start_all_gather(out, mine, axis, wire, tag)
        if self.allreduce_fetch and axis.size > 1:
            n = mine.numel()
            out.zero_()
            out[axis.rank * n:(axis.rank + 1) * n].copy_(mine)
            return comm.start_all_reduce(out, axis, tag)
        return comm.start_all_gather_into(out, mine, axis, tag)

    def _reduce_hop(self, out: torch.Tensor, t: torch.Tensor, axis: AxisGroup,
                    tag: object, wire: QuantizedWire | None = None) -> Work:
        if wire is not None:
            return quantize.start_reduce_scatter(out, t, axis, wire, tag)
        return comm.start_reduce_scatter(out, t, axis, tag)

    def _sum_hop(self, t: torch.Tensor, axis: AxisGroup, tag: object,
                 wire: QuantizedWire | None = None) -> Work:
        if wire is None:
            return comm.start_all_reduce(t, axis, tag)
        chunk = t.numel() // axis.size
        mine = t[axis.rank * chunk:(axis.rank + 1) * chunk]
        return Chain(quantize.start_reduce_scatter(mine, t, axis, wire, tag),
                     lambda: quantize.start_all_gather(t, mine, axis, wire, tag))

    def _reduce_in_place(self, grads: torch.Tensor, axis: AxisGroup, tag: object,
                         wire: QuantizedWire | None = None) -> tuple[Work, torch.Tensor]:
        chunk = grads.numel() // axis.size
        out = grads[axis.rank * chunk:(axis.rank + 1) * chunk]
        return self._reduce_hop(out, grads, axis, tag, wire), out


class Hybrid(Flat):
    """Shards over the node; the nodes' shard gradients summed once per step."""

    def __init__(self, dp: AxisGroup, intra: AxisGroup, inter: AxisGroup,
                 parallel: ParallelConfig) -> None:
        super().__init__(dp, intra, inter, parallel)
        self.shard_axis = intra
        self.replica_axis = inter
        self._sum_wire: QuantizedWire | None = None

    @property
    def align(self) -> int:
        """k; D when the shard's sum is quantized: it is cut over the n nodes."""
        return self.dp.size if self.quantize_grads else self.intra.size

    @property
    def slice_index(self) -> int:
        return self.intra.rank

    def attach(self, layout: FlatLayout, dtype: torch.dtype, device: torch.device,
               slot_of: dict[int, int]) -> None:
        super().attach(layout, dtype, device, slot_of)
        if self.quantize_grads:
            self._sum_wire = self._wire(layout.numel // self.intra.size, self.inter.size,
                                        device)

    def _weighed(self, numel: int) -> tuple[int, int]:
        return numel, self.intra.size

    def _graded(self, numel: int) -> None:
        """The units' reductions stay in the node; the step's sum crosses (``finish``)."""

    def gather(self, unit: int, full: torch.Tensor, mine: torch.Tensor) -> Work:
        return self._gather_hop(full, mine, self.intra, ("unit", unit),
                                self._weight_wires.get(self._slot_of[unit]))

    def reduce(self, unit: int, grads: torch.Tensor) -> tuple[Work, torch.Tensor]:
        return self._reduce_in_place(grads, self.intra, ("unit", unit))

    def finish(self, shard_grads: torch.Tensor) -> None:
        work = self._sum_hop(shard_grads, self.inter, ("shard",), self._sum_wire)
        if work is not None:
            work.wait()


class Secondary(Flat):
    """World shards for the optimizer, a node-local secondary shard for the re-gathers."""

    levels = 2

    def __init__(self, dp: AxisGroup, intra: AxisGroup, inter: AxisGroup,
                 parallel: ParallelConfig) -> None:
        super().__init__(dp, intra, inter, parallel)
        self._views: list[torch.Tensor] = []  # unit -> its secondary shard (N/k)
        self._fresh: list[bool] = []  # unit -> its secondary holds the current weights

    @property
    def slice_index(self) -> int:
        return self.intra.rank * self.inter.size + self.inter.rank

    def attach(self, layout: FlatLayout, dtype: torch.dtype, device: torch.device,
               slot_of: dict[int, int]) -> None:
        super().attach(layout, dtype, device, slot_of)
        k = self.intra.size
        buffer = torch.zeros(layout.numel // k, dtype=dtype, device=device)  # [stage / k]
        self._views = [buffer[b.start // k:b.end // k] for b in layout.buckets]
        self._fresh = [False] * len(layout.buckets)
        self.secondary_numel = buffer.numel()

    def _weighed(self, numel: int) -> tuple[int, int]:
        return numel // self.intra.size, self.inter.size  # the inter hop, into the secondary

    _graded = _weighed  # the inter level, of the node's chunk

    def stale(self) -> None:
        self._fresh = [False] * len(self._fresh)

    def gather(self, unit: int, full: torch.Tensor, mine: torch.Tensor) -> Work:
        secondary, tag = self._views[unit], ("unit", unit)
        if self._fresh[unit]:
            return self._gather_hop(full, secondary, self.intra, tag)
        self._fresh[unit] = True
        first = self._gather_hop(secondary, mine, self.inter, tag,
                                 self._weight_wires.get(self._slot_of[unit]))
        return Chain(first, lambda: self._gather_hop(full, secondary, self.intra, tag))

    def reduce(self, unit: int, grads: torch.Tensor) -> tuple[Work, torch.Tensor]:
        tag, wire = ("unit", unit), self._grad_wires.get(self._slot_of[unit])
        first, chunk = self._reduce_in_place(grads, self.intra, tag)
        sub = chunk.numel() // self.inter.size
        out = chunk[self.inter.rank * sub:(self.inter.rank + 1) * sub]
        return Chain(first, lambda: self._reduce_hop(out, chunk, self.inter, tag, wire)), out


def build_hops(parallel: ParallelConfig, dp: AxisGroup,
               nodes: tuple[AxisGroup, AxisGroup] | None) -> Flat:
    """The mode ``parallel`` asks for; ``nodes``: (dp_intra, dp_inter), or None for one
    node (a layout built without processes, for the memory model)."""
    intra, inter = nodes or (dp, AxisGroup.single())
    mode = (Hybrid if parallel.zero3_shard_group == "node" else
            Secondary if parallel.zero3_secondary_shard == "node" else Flat)
    return mode(dp, intra, inter, parallel)
