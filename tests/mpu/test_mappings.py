"""Collectives in comm.py and the TP-region autograd functions, forward and backward."""

from __future__ import annotations

import pytest
import torch

from megatron3d.mpu import comm
from megatron3d.mpu.mappings import (
    copy_to_tp_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    scatter_to_tp_region,
)
from megatron3d.mpu.state import AxisGroup, ParallelState
from megatron3d.mpu.traffic import CommCounter, observing
from tests.helpers.dist import run_distributed


def _full(*shape: int) -> torch.Tensor:
    return torch.arange(float(torch.Size(shape).numel())).reshape(shape)


def _check_collectives(tp: AxisGroup) -> None:
    rank, size = tp.rank, tp.size
    full = _full(4, 6, 8)  # [4, 6, 8]
    for dim in (0, 1, 2, -1):
        mine = full.chunk(size, dim=dim)[rank]
        torch.testing.assert_close(comm.all_gather(mine, tp, dim=dim), full, rtol=0, atol=0)
    for dim in (0, 1, -1):
        got = comm.reduce_scatter(full * (rank + 1), tp, dim=dim)
        expected = (full * sum(range(1, size + 1))).chunk(size, dim=dim)[rank]
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    t = torch.full((3,), float(rank))
    assert comm.all_reduce(t, tp, op=comm.MAX) is t and t.tolist() == [size - 1.0] * 3
    t = torch.full((3,), float(rank))
    assert comm.broadcast(t, tp, src_index=1).tolist() == [1.0] * 3
    # Both directions at once between ranks 0 and 1 (a pipeline's steady state).
    if rank in (0, 1):
        peer = 1 - rank
        got = torch.empty(2)
        comm.exchange([(torch.tensor([7.0, 8.0]) + rank, peer)], [(got, peer)], tp)
        assert got.tolist() == [7.0 + peer, 8.0 + peer]


def _check_counter(tp: AxisGroup) -> None:
    counter = CommCounter(only=(tp,))
    with observing(counter):
        comm.all_reduce(torch.ones(10), tp)  # 40 bytes
        comm.all_reduce(torch.ones(4, dtype=torch.float64), tp)  # 32 bytes
        comm.all_gather(torch.ones(3), tp, dim=0)  # 12 bytes
        comm.all_reduce(torch.ones(10), AxisGroup.single())  # size 1: no traffic
    comm.all_reduce(torch.ones(10), tp)  # not counted: no observer attached
    assert dict(counter.bytes) == {"all_reduce": 72, "all_gather": 12}
    assert dict(counter.calls) == {"all_reduce": 2, "all_gather": 1}
    assert counter.total_bytes() == 84
    # Backward collectives of the mappings are seen too.
    counter.reset()
    x = torch.ones(2, 5, requires_grad=True)
    with observing(counter):
        copy_to_tp_region(x, tp).sum().backward()
    assert dict(counter.bytes) == {"all_reduce": 40}


def _check_mappings(tp: AxisGroup) -> None:
    rank, size = tp.rank, tp.size
    weight = float(rank + 1)  # makes each rank's upstream gradient different
    total = float(sum(range(1, size + 1)))

    x = torch.ones(3, 4, requires_grad=True)
    y = copy_to_tp_region(x, tp)
    assert torch.equal(y, x)
    (y * weight).sum().backward()
    assert torch.equal(x.grad, torch.full((3, 4), total))  # all-reduced

    x = torch.full((3, 4), weight, requires_grad=True)
    x_before = x.detach().clone()
    y = reduce_from_tp_region(x * 1.0, tp)
    assert torch.equal(y, torch.full((3, 4), total))
    (y * weight).sum().backward()
    assert torch.equal(x.grad, torch.full((3, 4), weight))  # identity
    assert torch.equal(x.detach(), x_before)

    full = _full(3, 4 * size).requires_grad_()
    y = scatter_to_tp_region(full, tp)
    assert torch.equal(y, full.detach().chunk(size, dim=-1)[rank])
    (y * weight).sum().backward()  # grad gathered: each chunk carries its rank's weight
    expected = torch.cat([torch.full((3, 4), float(r + 1)) for r in range(size)], dim=-1)
    assert torch.equal(full.grad, expected)

    mine = _full(3, 4 * size).chunk(size, dim=-1)[rank].clone().requires_grad_()
    y = gather_from_tp_region(mine, tp)
    assert torch.equal(y, _full(3, 4 * size))
    (y * _full(3, 4 * size)).sum().backward()  # grad split back
    assert torch.equal(mine.grad, mine.detach())


def _worker() -> None:
    tp = ParallelState.build(2, 1).tp
    _check_collectives(tp)
    _check_counter(tp)
    _check_mappings(tp)


def test_comm_and_mappings_tp2() -> None:
    run_distributed(_worker, 2)


def test_size_one_axis_is_identity_without_distributed() -> None:
    one = AxisGroup.single()
    t = torch.arange(6.0).reshape(2, 3)
    assert comm.all_reduce(t, one) is t
    assert comm.all_gather(t, one, dim=1) is t
    assert comm.reduce_scatter(t, one, dim=0) is t
    assert comm.broadcast(t, one, src_index=0) is t
    _check_mappings(one)


def test_non_member_axis_refuses_collectives() -> None:
    absent = AxisGroup.absent()
    assert not absent.is_member
    with pytest.raises(ValueError, match="not a member"):
        comm.all_reduce(torch.ones(2), absent)


def test_a_coalesced_batch_gives_every_transfer_one_work_waited_once(monkeypatch):
    """On an axis without a reverse group, NCCL coalesces the batch of sends and receives
    into one work: every transfer gets it, and it is waited for once however many transfers
    ask (a second wait is not safe on every backend)."""

    class OneWork:
        waits = 0

        def wait(self) -> None:
            OneWork.waits += 1

    monkeypatch.setattr(comm.dist, "P2POp", lambda *args, **kwargs: args)
    monkeypatch.setattr(comm.dist, "batch_isend_irecv", lambda ops: [OneWork()])
    axis = AxisGroup(group=object(), rank=0, size=2, ranks=(0, 1), name="pp")
    works = comm.start_exchange([(torch.ones(2), 1)], [(torch.empty(2), 1), (torch.empty(2), 1)],
                                axis)
    assert len(works) == 3
    for work in works:
        work.wait()
    assert OneWork.waits == 1


def test_with_a_reverse_group_each_transfer_is_posted_alone_in_link_order(monkeypatch):
    """NCCL's path: never a batch; each transfer its own work, on ``group`` towards a higher
    index and on ``reverse`` towards a lower one, posted link by link (the link with the
    lower ranks first; on a link, towards the higher first), so both ends of every link
    post its directions in the same order. Mutations: one group for both directions, or
    the order given, fail."""
    posted = []

    def post(kind):
        def start(tensor, peer, group):
            posted.append((kind, peer, group))
            return posted[-1]  # the work: what it moves
        return start

    monkeypatch.setattr(comm.dist, "isend", post("send"))
    monkeypatch.setattr(comm.dist, "irecv", post("recv"))
    monkeypatch.setattr(comm.dist, "batch_isend_irecv", None)
    axis = AxisGroup(group="up", rank=1, size=3, ranks=(10, 11, 12), name="pp", reverse="down")
    sends = [(torch.ones(2), 2), (torch.ones(2), 0)]
    recvs = [(torch.empty(2), 0), (torch.empty(2), 2)]
    works = comm.start_exchange(sends, recvs, axis)
    assert posted == [("recv", 10, "up"), ("send", 10, "down"),
                      ("send", 12, "up"), ("recv", 12, "down")]
    assert works == [("send", 12, "up"), ("send", 10, "down"),  # in the order given
                     ("recv", 10, "up"), ("recv", 12, "down")]
