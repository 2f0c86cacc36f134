"""Every collective and point-to-point call goes through here.

Why one module: the group is always explicit (an ``AxisGroup``), a size-1 axis returns without
touching torch.distributed (so single-process code needs no process group), torch API drift is
absorbed in one place, and every collective is shown to the observers of ``traffic.py``
(counters in tests and benchmarks, recorders), which live outside the parallel state: when it
is issued, and once posted with the backend's own work (before any wrapper of ours), or as a
blocking call that returned.

Reductions and broadcast work in place on the given tensor and return it (like torch);
callers that must not modify their input clone first.

Point-to-point (``start_exchange``, the pipeline's transfers) gives every transfer a work of
its own, so that the engine waits for a received tensor only where it is read. Per backend:

- gloo: one ``batch_isend_irecv`` on ``axis.group``, kept because it is already right there.
  gloo does not coalesce a batch: it posts each operation alone and returns one work per
  operation, moved by gloo's own threads with no streams, so a pending receive never holds
  a send back, the order across peers and directions is free, and one group is enough.
- NCCL: ``batch_isend_irecv`` coalesces the batch into one NCCL group with one work, so the
  first receive waited for would wait for every transfer of the exchange, sends included.
  Each transfer is therefore posted alone (``isend``/``irecv``). ProcessGroupNCCL runs a
  lone transfer on a two-rank communicator its process group keeps for that pair of ranks,
  on that communicator's one CUDA stream: a send and a receive between the same two ranks
  run in the order posted, a receive behind a send waits for it, and a large send finishes
  only once the peer's receive runs (the two kernels meet). Two neighbours that both post a
  send before the receive of the other's message would wait for each other forever.
  Megatron-LM's unbatched path posts even and odd pipeline ranks in opposite orders so both
  ends of a link agree, and at PP = 2 moves one direction to the world group so the two
  overlap. Here the pipeline axis off gloo has a second group over the same ranks
  (``AxisGroup.reverse``, at every PP): a transfer towards a higher member index goes on
  ``group``, towards a lower one on ``reverse``. Each stream then carries one direction of
  one link, whose sends and receives pair in the order posted; a receive waits only for
  the messages sent before it on that link and direction, never for a send or a later
  receive.

Why that cannot deadlock: number the transfers in the order the blocking model of
``pipeline/simulate.py`` (an exchange waits for all its transfers) matches them. On NCCL a
transfer waits for those before it on its two streams (earlier messages of its link and
direction, matched earlier in the model too) and for the compute work posted before it,
which waits for the receives it reads and the sends of earlier exchanges (matched before, in
the model, which computes only once an exchange is complete). Every wait is for an earlier
transfer, so the earliest unfinished one can always run: a schedule the simulator accepts
finishes.

Within an exchange the transfers are posted in link order (``link_order``: lower index,
higher index, towards the higher first), the same at both ends of every link. NCCL creates
a pair's communicator at the first transfer over it and blocks the host until the other end
comes; meeting them in one global order cannot deadlock, and the engine's handshake meets
every link so, before any schedule runs. Where torch puts several links or directions on one
stream (a process group with a bound ``device_id`` runs lone transfers on its one
communicator; megatron3d binds none), link order still mirrors each link's sequence at its
two ends (the lower rank sends first, as Megatron's even ranks do), and
``tests/pipeline/test_nccl_streams.py`` runs every schedule under each such mapping.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist

from megatron3d.mpu import host_staging, traffic
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
    if _gloo_on_device(t, axis):  # this rank's rows among zeros, summed: the gathered values
        out.zero_()[axis.rank * src.shape[0]:(axis.rank + 1) * src.shape[0]].copy_(src)
        dist.all_reduce(out, group=axis.group)
    else:
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
    rows = src.shape[0] // axis.size
    if _gloo_on_device(t, axis):  # the whole sum, then this rank's rows (``t`` untouched)
        summed = src.clone()
        dist.all_reduce(summed, op=op, group=axis.group)
        out = summed[axis.rank * rows:(axis.rank + 1) * rows].clone()
    else:
        out = torch.empty((rows, *src.shape[1:]), dtype=t.dtype,
                          device=t.device)  # [d/size, ...rest]
        _reduce_scatter_single(out, src, op=op, group=axis.group)
    traffic.returned()
    return out.movedim(0, dim)


def all_to_all(t: torch.Tensor, axis: AxisGroup) -> torch.Tensor:
    """Cut ``t`` along dim 0 into one equal part per member and send part i to member i;
    returns the parts received, in member order along dim 0 (a new tensor)."""
    if axis.size == 1:
        return t
    _check(axis, "all_to_all", t)
    src = t.contiguous()
    if _gloo_on_device(t, axis):  # every rank's parts among zeros, summed; keep ours
        every = torch.zeros((axis.size, *src.shape), dtype=t.dtype, device=t.device)
        every[axis.rank].copy_(src)
        dist.all_reduce(every, group=axis.group)
        parts = every.view(axis.size, axis.size, -1, *src.shape[1:])  # [from, to, ...]
        out = parts[:, axis.rank].reshape(src.shape)
    else:
        out = torch.empty_like(src)
        dist.all_to_all_single(out, src, group=axis.group)
    traffic.returned()
    return out


def start_all_reduce(t: torch.Tensor, axis: AxisGroup, tag: object = None,
                     op: dist.ReduceOp = SUM) -> dist.Work | None:
    """Begin reducing flat ``t`` in place over the axis; wait on the returned work (None when
    there is nothing to do). For overlapping gradient reduction with backward, and agreeing
    on flags a step later. ``tag`` (here and below) tells the observers what the operation
    serves, e.g. a bucket or ZeRO unit."""
    if axis.size == 1:
        return None
    _check(axis, "all_reduce", t, tag=tag)
    return _posted(dist.all_reduce(t, op=op, group=axis.group, async_op=True))


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
        return work if out.data_ptr() == chunk.data_ptr() else Then(work,
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
                          tag: object = None, least_bytes: bool = False) -> dist.Work | None:
    """Begin ``all_gather_into``; wait on the returned work (None when already done). On
    NCCL the wait orders the caller's stream after the gather without blocking the host.
    ``least_bytes``: gloo's own all-gather even on host memory, where the in-place sum
    (``_in_place``) would move twice the bytes over the links (for gathers whose point is
    the bytes they save, e.g. int8 ones; ``t`` must then not be a chunk of ``out``)."""
    if axis.size == 1:
        if out.data_ptr() != t.data_ptr():
            out.copy_(t)
        return None
    _check(axis, "all_gather", t, tag=tag)
    if _in_place(axis) and (not least_bytes or _gloo_on_device(t, axis)):
        # every other chunk zero, then a sum: exactly the gathered values
        n = t.numel()
        mine = out[axis.rank * n:(axis.rank + 1) * n]
        if mine.data_ptr() != t.data_ptr():
            mine.copy_(t)
        out[:axis.rank * n].zero_()
        out[(axis.rank + 1) * n:].zero_()
        return _posted(dist.all_reduce(out, group=axis.group, async_op=True))
    return _posted(_all_gather_single(out, t, group=axis.group, async_op=True))


def start_all_to_all_into(out: torch.Tensor, t: torch.Tensor, axis: AxisGroup,
                          tag: object = None) -> Work | None:
    """Begin ``all_to_all`` of flat ``t`` into flat ``out`` (same size, not ``t``): part i
    of ``t`` goes to member i, ``out`` receives the parts in member order. One collective."""
    if axis.size == 1:
        out.copy_(t)
        return None
    _check(axis, "all_to_all", t, tag=tag)
    if _gloo_on_device(t, axis):  # every rank's parts among zeros, summed; keep ours
        every = torch.zeros((axis.size, t.numel()), dtype=t.dtype, device=t.device)
        every[axis.rank].copy_(t)
        work = _posted(dist.all_reduce(every, group=axis.group, async_op=True))
        parts = every.view(axis.size, axis.size, -1)  # [from, to, part]
        return Then(work, lambda: out.view(axis.size, -1).copy_(parts[:, axis.rank]))
    return _posted(dist.all_to_all_single(out, t, group=axis.group, async_op=True))


def _posted(work: dist.Work) -> dist.Work:
    """Show the observers the work of the operation just posted; return it."""
    traffic.posted((work,))
    return work


def _gloo_on_device(t: torch.Tensor, axis: AxisGroup) -> bool:
    """gloo runs only all-reduce and broadcast on tensors outside host memory (CUDA tensors,
    when several ranks share a GPU over gloo): other collectives are built from those."""
    return t.device.type != "cpu" and dist.get_backend(axis.group) == "gloo"


def _in_place(axis: AxisGroup) -> bool:
    """gloo runs an all-gather or reduce-scatter into a tensor as an all-reduce of a
    temporary copy of the whole buffer; the same all-reduce in the caller's own buffers
    needs no copy and, measured on 4 CPU ranks with 28 MB buffers, takes half the time of
    gloo's own. NCCL does both in place natively."""
    return dist.get_backend(axis.group) == "gloo"


class Then:
    """A posted collective (or None: nothing in flight), and what to do once it is done (on
    CUDA, queued on the compute stream the wait orders after it)."""

    def __init__(self, work: Work | None, then: Callable[[], object]) -> None:
        self._work, self._then = work, then

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
        self._then()


def broadcast(t: torch.Tensor, axis: AxisGroup, src_index: int) -> torch.Tensor:
    """Copy the ``src_index``-th member's ``t`` to every member, in place; returns ``t``."""
    if axis.size == 1:
        return t
    _check(axis, "broadcast", t, axis.ranks[src_index])
    dist.broadcast(t, src=axis.ranks[src_index], group=axis.group)
    traffic.returned()
    return t


class Work(Protocol):
    """A posted transfer: ``wait`` returns once it is done (on NCCL: once the caller's stream
    is ordered after it)."""

    def wait(self) -> object: ...


class _Shared:
    """One work standing for every transfer of a coalesced batch (an exchange on an axis
    without a ``reverse`` group, off gloo): waited for once, by the first transfer needed (a
    second wait is not safe on every backend)."""

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
    tag])`` (pipeline neighbours sending to each other at once cannot deadlock); returns one
    work per transfer, the sends' first, in the order given. Wait a receive's work before
    reading its buffer; a send's holds its tensor until waited. On NCCL a wait orders the
    caller's stream after that transfer alone (the host does not block); see the module
    docstring for how each backend posts.
    This is the only point-to-point path, and transfers between two ranks in one direction
    are posted in the order given, so messages between two ranks always travel in order."""
    if host_staging.needed(sends, recvs, axis):  # gloo sends only host memory
        return host_staging.start(sends, recvs, lambda s, r: start_exchange(s, r, axis))
    transfers = ([(True, t.contiguous(), i, tag) for t, i, *tag in sends]
                 + [(False, t, i, tag) for t, i, *tag in recvs])
    for sending, t, i, tag in transfers:
        _check(axis, "send" if sending else "recv", t, axis.ranks[i], tag[0] if tag else None)
    if not transfers:
        return []
    if axis.reverse is not None:
        return _one_by_one(transfers, axis)
    works = dist.batch_isend_irecv([
        dist.P2POp(dist.isend if sending else dist.irecv, t, axis.ranks[i], group=axis.group)
        for sending, t, i, _ in transfers])
    if len(works) == 1:
        traffic.posted(works * len(transfers))
        return [_Shared(works[0])] * len(transfers)
    assert len(works) == len(transfers), f"{len(works)} works for {len(transfers)} transfers"
    traffic.posted(works)
    return works


def link_of(me: int, peer: int, sending: bool) -> tuple[int, int, int]:
    """The one-way link a transfer between members ``me`` and ``peer`` of an axis travels,
    named alike at both ends: (lower index, higher index, 0 towards the higher or 1 towards
    the lower)."""
    src, dst = (me, peer) if sending else (peer, me)
    return min(src, dst), max(src, dst), int(src > dst)


def link_order(me: int, transfers: list[tuple[int, bool]]) -> list[int]:
    """Indices of ``transfers`` ``(peer index, sending)`` in the order they are posted one
    by one: by ``link_of``, and as given within one link and direction (a stable sort)."""
    return sorted(range(len(transfers)), key=lambda k: link_of(me, *transfers[k]))


def _one_by_one(transfers: list[tuple], axis: AxisGroup) -> list[Work]:
    """Post each transfer alone, in link order, on its direction's group; the works in the
    given order (NCCL)."""
    works: dict[int, Work] = {}
    for k in link_order(axis.rank, [(i, sending) for sending, _, i, _ in transfers]):
        sending, t, i, _ = transfers[k]
        post = dist.isend if sending else dist.irecv
        lower = link_of(axis.rank, i, sending)[2]
        works[k] = post(t, axis.ranks[i], group=axis.reverse if lower else axis.group)
    ordered = [works[k] for k in range(len(transfers))]
    traffic.posted(ordered)  # in the order the transfers were notified
    return ordered


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
