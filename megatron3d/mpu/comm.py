"""Every collective and point-to-point call goes through here.

Why one module: the group is always explicit (an ``AxisGroup``), a size-1 axis returns without
touching torch.distributed (so single-process code needs no process group), torch API drift is
absorbed in one place, and every collective is shown to the observers of ``traffic.py``
(counters in tests and benchmarks, recorders), which live outside the parallel state: when it
is issued, and once posted with the backend's own work (before any wrapper of ours), or as a
blocking call that returned.

Reductions and broadcast work in place on the given tensor and return it (like torch);
callers that must not modify their input clone first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist

from megatron3d.mpu import traffic
from megatron3d.mpu.state import AxisGroup

SUM = dist.ReduceOp.SUM
MAX = dist.ReduceOp.MAX
MIN = dist.ReduceOp.MIN

# torch >= 2.13 renamed the single-tensor collectives; older versions only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = (getattr(dist, "reduce_scatter_single", None)
                          or dist.reduce_scatter_tensor)


def _check(axis: AxisGroup, kind: str, tensor: torch.Tensor, peer: int | None = None,
           tag: object = None) -> None:
    if axis.group is None:
        raise ValueError(f"{kind} on an axis of size {axis.size} without a process group "
                         "(this rank is not a member, or the state was built without dist)")
    traffic.notify(kind, tensor, axis, peer, tag)


def all_reduce(t: torch.Tensor, axis: AxisGroup, op: dist.ReduceOp = SUM) -> torch.Tensor:
    """Reduce ``t`` across the axis in place; returns ``t``."""
    if axis.size == 1:
        return t
    _check(axis, "all_reduce", t)
    dist.all_reduce(t, op=op, group=axis.group)
    traffic.returned()
    return t


def any_rank(mine: bool, axis: AxisGroup, device: torch.device) -> bool:
    """Whether any rank of the axis says ``mine`` (one all-reduce and a host sync: for
    decisions outside the step, which every rank must take alike)."""
    flag = torch.tensor([float(mine)], device=device)
    return bool(all_reduce(flag, axis, op=MAX).item())


def all_gather(t: torch.Tensor, axis: AxisGroup, dim: int) -> torch.Tensor:
    """Concatenate every rank's ``t`` along ``dim`` in axis order (a new tensor)."""
    if axis.size == 1:
        return t
    _check(axis, "all_gather", t)
    dim = dim % t.dim()
    src = t.movedim(dim, 0).contiguous()  # [d, ...rest]
    out = torch.empty((axis.size * src.shape[0], *src.shape[1:]), dtype=t.dtype,
                      device=t.device)  # [size * d, ...rest]
    _all_gather_single(out, src, group=axis.group)
    traffic.returned()
    if dim == 0:
        return out
    # Gathered along a moved-to-front dim: put (size, d) back at dim, then merge them.
    parts = out.view(axis.size, *src.shape)  # [size, d, ...rest]
    merged = parts.movedim((0, 1), (dim, dim + 1))  # [..., size, d, ...]
    return merged.reshape(*t.shape[:dim], axis.size * t.shape[dim], *t.shape[dim + 1:])


def reduce_scatter(t: torch.Tensor, axis: AxisGroup, dim: int,
                   op: dist.ReduceOp = SUM) -> torch.Tensor:
    """Sum ``t`` across the axis and keep this rank's chunk along ``dim`` (a new tensor)."""
    if axis.size == 1:
        return t
    _check(axis, "reduce_scatter", t)
    dim = dim % t.dim()
    if t.shape[dim] % axis.size != 0:
        raise ValueError(f"reduce_scatter: dim {dim} of size {t.shape[dim]} does not divide "
                         f"by axis size {axis.size}")
    src = t.movedim(dim, 0).contiguous()  # [d, ...rest]
    out = torch.empty((src.shape[0] // axis.size, *src.shape[1:]), dtype=t.dtype,
                      device=t.device)  # [d/size, ...rest]
    _reduce_scatter_single(out, src, op=op, group=axis.group)
    traffic.returned()
    return out.movedim(0, dim)


def start_all_reduce(t: torch.Tensor, axis: AxisGroup, tag: object = None) -> dist.Work | None:
    """Begin summing flat ``t`` in place over the axis; wait on the returned work (None when
    there is nothing to do). For overlapping gradient reduction with backward. ``tag`` (here
    and below) tells the observers what the operation serves, e.g. a bucket or ZeRO unit."""
    if axis.size == 1:
        return None
    _check(axis, "all_reduce", t, tag=tag)
    return _posted(dist.all_reduce(t, group=axis.group, async_op=True))


def start_reduce_scatter(out: torch.Tensor, t: torch.Tensor, axis: AxisGroup,
                         tag: object = None) -> Work | None:
    """Begin summing flat ``t`` over the axis into ``out`` (this rank's 1/size chunk). ``t``
    is the caller's scratch: on gloo it is summed in place (``_in_place``). ``out`` may be
    this rank's own chunk of ``t`` (in place, no output buffer)."""
    if axis.size == 1:
        out.copy_(t)
        return None
    _check(axis, "reduce_scatter", t, tag=tag)
    if _in_place(axis):
        chunk = t[axis.rank * out.numel():(axis.rank + 1) * out.numel()]
        work = _posted(dist.all_reduce(t, group=axis.group, async_op=True))
        return work if out.data_ptr() == chunk.data_ptr() else _Then(work,
                                                                    lambda: out.copy_(chunk))
    return _posted(_reduce_scatter_single(out, t, group=axis.group, async_op=True))


def all_gather_into(out: torch.Tensor, t: torch.Tensor, axis: AxisGroup,
                    tag: object = None) -> None:
    """Concatenate every rank's flat ``t`` into ``out``. ``t`` may be this rank's own chunk
    of ``out`` (in place, no staging copy)."""
    work = start_all_gather_into(out, t, axis, tag)
    if work is not None:
        work.wait()


def start_all_gather_into(out: torch.Tensor, t: torch.Tensor, axis: AxisGroup,
                          tag: object = None) -> dist.Work | None:
    """Begin ``all_gather_into``; wait on the returned work (None when already done). On
    NCCL the wait orders the caller's stream after the gather without blocking the host."""
    if axis.size == 1:
        if out.data_ptr() != t.data_ptr():
            out.copy_(t)
        return None
    _check(axis, "all_gather", t, tag=tag)
    if _in_place(axis):  # every other chunk zero, then a sum: exactly the gathered values
        n = t.numel()
        mine = out[axis.rank * n:(axis.rank + 1) * n]
        if mine.data_ptr() != t.data_ptr():
            mine.copy_(t)
        out[:axis.rank * n].zero_()
        out[(axis.rank + 1) * n:].zero_()
        return _posted(dist.all_reduce(out, group=axis.group, async_op=True))
    return _posted(_all_gather_single(out, t, group=axis.group, async_op=True))


def _posted(work: dist.Work) -> dist.Work:
    """Show the observers the work of the operation just posted; return it."""
    traffic.posted((work,))
    return work


def _in_place(axis: AxisGroup) -> bool:
    """gloo runs an all-gather or reduce-scatter into a tensor as an all-reduce of a
    temporary copy of the whole buffer; the same all-reduce in the caller's own buffers
    needs no copy and, measured on 4 CPU ranks with 28 MB buffers, takes half the time of
    gloo's own. NCCL does both in place natively."""
    return dist.get_backend(axis.group) == "gloo"


class _Then:
    """A posted collective, and what to do on the host once it is done."""

    def __init__(self, work: Work, then: Callable[[], object]) -> None:
        self._work, self._then = work, then

    def wait(self) -> None:
        self._work.wait()
        self._then()


def broadcast(t: torch.Tensor, axis: AxisGroup, src_index: int) -> torch.Tensor:
    """Copy the ``src_index``-th member's ``t`` to every member, in place; returns ``t``."""
    if axis.size == 1:
        return t
    _check(axis, "broadcast", t)
    dist.broadcast(t, src=axis.ranks[src_index], group=axis.group)
    traffic.returned()
    return t


class Work(Protocol):
    """A posted transfer: ``wait`` returns once it is done (on NCCL: once the caller's stream
    is ordered after it)."""

    def wait(self) -> object: ...


class _Shared:
    """One work standing for every transfer of a coalesced batch: waited for once, by the
    first transfer needed (a second wait is not safe on every backend)."""

    def __init__(self, work: Work) -> None:
        self._work: Work | None = work

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None


def exchange(sends: list[tuple], recvs: list[tuple], axis: AxisGroup) -> None:
    """``start_exchange``, then wait for every transfer."""
    for work in start_exchange(sends, recvs, axis):
        work.wait()


def start_exchange(sends: list[tuple], recvs: list[tuple],
                   axis: AxisGroup) -> list[Work]:
    """Post every send ``(tensor, dst_index[, tag])`` and receive ``(buffer, src_index[,
    tag])`` together (pipeline neighbours sending to each other at once cannot deadlock);
    returns one work per transfer, the sends' first, in the order given. Wait a receive's
    work before reading its buffer; a send's holds its tensor until waited. Backends that
    coalesce the batch (NCCL) give one work for all of it: every transfer then gets that work,
    waited for once, which orders the caller's stream after the whole batch (the host does
    not block).
    This is the only point-to-point path, so messages between two ranks always travel in the
    order posted."""
    ops = []
    for t, dst, *tag in sends:
        peer = axis.ranks[dst]
        _check(axis, "send", t, peer, tag[0] if tag else None)
        ops.append(dist.P2POp(dist.isend, t.contiguous(), peer, group=axis.group))
    for t, src, *tag in recvs:
        peer = axis.ranks[src]
        _check(axis, "recv", t, peer, tag[0] if tag else None)
        ops.append(dist.P2POp(dist.irecv, t, peer, group=axis.group))
    if not ops:
        return []
    works = dist.batch_isend_irecv(ops)
    if len(works) == 1:
        traffic.posted(works * len(ops))
        return [_Shared(works[0])] * len(ops)
    assert len(works) == len(ops), f"{len(works)} works for {len(ops)} transfers"
    traffic.posted(works)
    return works


def all_reduce_coalesced(tensors: list[torch.Tensor], axis: AxisGroup) -> None:
    """Sum each tensor in place over ``axis`` with a single collective on their concatenation
    (many small gradients, e.g. sequence-parallel norm weights)."""
    if axis.size == 1 or not tensors:
        return
    flat = all_reduce(torch.cat([t.reshape(-1) for t in tensors]), axis)
    for t, part in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True):
        t.copy_(part.view_as(t))


def barrier(axis: AxisGroup) -> None:
    """Wait until every member of the axis gets here."""
    if axis.size > 1:
        _check(axis, "barrier", torch.empty(0))
        dist.barrier(group=axis.group)
        traffic.returned()
