"""Hang diagnostics from completion, not issue order: the flight recorder learns when each
operation completes (polled, never waited), ``mpu/comm.py`` hands it every work, and the
report finds the stuck rank although the others' hosts issued operations past it."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

from megatron3d.mpu import comm, traffic
from megatron3d.mpu.state import AxisGroup, ParallelState
from megatron3d.resilience.flight_recorder import FlightRecorder
from megatron3d.resilience.hang_dump import dump_path, read_dump, write_dump
from megatron3d.resilience.hang_report import analyse, format_report
from tests.helpers.dist import run_distributed

X = torch.zeros(4)


class FakeWork:
    """A posted operation that completes when the test says so (as a GPU's work does, while
    the host runs on)."""

    def __init__(self, done: bool = False) -> None:
        self.done = done

    def is_completed(self) -> bool:
        return self.done


def _axis(ranks: tuple[int, ...], rank: int, name: str) -> AxisGroup:
    return AxisGroup(group=name, rank=ranks.index(rank), size=len(ranks), ranks=ranks,
                     name=name)


def test_a_work_that_completes_late_is_seen_at_the_next_poll():
    rec = FlightRecorder(size=16)
    dp = _axis((0, 1), 0, "dp")
    late, early = FakeWork(), FakeWork(done=True)
    rec("all_reduce", X, dp, tag=("bucket", 0))
    rec.posted([late])
    rec("all_reduce", X, dp)
    rec.posted([None])  # a blocking call that returned, on CPU: done
    rec("all_reduce", X, dp, tag=("bucket", 1))
    rec.posted([early])
    rec("all_reduce", X, dp)  # posted never: the call is still blocked
    assert [op["completed"] for op in rec.snapshot()] == [False, True, True, False]
    late.done = True
    gone = weakref.ref(late)
    del late
    assert [op["completed"] for op in rec.snapshot()] == [True, True, True, False]
    gc.collect()
    assert gone() is None, "a completed work is let go of (it holds its tensors)"


def test_a_blocking_call_on_a_gpu_completes_when_its_stream_mark_does():
    marks: list[FakeWork] = []

    def marker():
        marks.append(FakeWork())
        return marks[-1].is_completed

    rec = FlightRecorder(size=16, marker=marker)
    rec("all_reduce", X, _axis((0, 1), 0, "tp"))
    rec.posted([None])
    assert not rec.snapshot()[0]["completed"]  # the host returned, the device has not
    marks[0].done = True
    assert rec.snapshot()[0]["completed"]


def _every_kind(coalesce: bool) -> list[list[tuple[str, bool]]]:
    """Each of comm's operations on 2 gloo ranks: [(kind, completed)] snapshots before and
    after waiting an exchange's receive, then after everything was waited for. ``coalesce``:
    the backend answers a batch of transfers with one work, as NCCL does."""
    if coalesce:
        batch = dist.batch_isend_irecv
        dist.batch_isend_irecv = lambda ops: [_Coalesced(batch(ops))]
    state = ParallelState.build(1, 2)
    axis, rank = state.pp, state.pp.rank
    rec = FlightRecorder(size=64)
    snapshots = []
    with traffic.observing(rec):
        comm.all_reduce(X.clone(), axis)
        comm.all_gather(X.clone(), axis, 0)
        comm.reduce_scatter(X.clone(), axis, 0)
        comm.broadcast(X.clone(), axis, 0)
        comm.barrier(axis)
        comm.any_rank(False, axis, torch.device("cpu"))
        comm.start_all_reduce(X.clone(), axis).wait()
        flat = torch.arange(4.0)
        comm.start_reduce_scatter(torch.zeros(2), flat, axis).wait()  # gloo: comm.Then
        comm.start_all_gather_into(torch.zeros(8), X.clone(), axis).wait()
        works = comm.start_exchange([(X.clone(), 1 - rank)], [(torch.empty(4), 1 - rank)],
                                    axis)
        snapshots.append(rec.snapshot())
        for work in works:
            work.wait()
        snapshots.append(rec.snapshot())
    return [[(op["kind"], op["completed"]) for op in ops] for ops in snapshots]


class _Coalesced:
    """One work for a whole batch of transfers."""

    def __init__(self, works: list) -> None:
        self._works = works

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def wait(self) -> None:
        for w in self._works:
            w.wait()


EVERY_KIND = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "barrier",
              "all_reduce", "all_reduce", "reduce_scatter", "all_gather", "send", "recv"]


def test_every_operation_comm_posts_is_recorded_as_completed_once_waited():
    for coalesce in (False, True):  # gloo's works; one shared work (comm._Shared)
        for before, after in run_distributed(_every_kind, 2, coalesce):
            assert [kind for kind, _ in after] == EVERY_KIND
            assert all(done for _, done in after), (coalesce, after)
            # Polling never waits: gloo completes a receive when waited for.
            assert before[:-2] == after[:-2] and not before[-1][1], (coalesce, before)


# PP=2 x DP=2 (pipeline pairs 0-2 and 1-3, DP pairs 0-1 and 2-3), one micro-batch. Rank 3's
# host stopped (stuck in its forward): it never sends B0. Rank 1's receive of B0 therefore
# never completes, but its host ran on and issued both gradient buckets; rank 0's host issued
# only the first and blocks there. By issue order rank 0 is behind in DP (rank 1 issued #1, it
# did not) and waits for nobody: that reasoning named it, an innocent rank. By completion,
# rank 0 waits for rank 1, stuck earlier in its receive from rank 3.
SIZES = {"tp": 1, "pp": 2, "dp": 2}


def _rank_ops(rank: int) -> list[dict]:
    pp = _axis((0, 2) if rank in (0, 2) else (1, 3), rank, "pp")
    dp = _axis((0, 1) if rank < 2 else (2, 3), rank, "dp")
    peer = pp.ranks[1 - pp.rank]
    first = pp.rank == 0
    never, late = FakeWork(), FakeWork()
    rec = FlightRecorder(size=32)
    rec.iteration = 3
    if rank == 3:  # received F0, then stopped issuing
        rec("recv", X, pp, peer, ("F", 0))
        rec.posted([FakeWork(done=True)])
        return rec.snapshot()
    rec("send" if first else "recv", X, pp, peer, ("F", 0))
    rec.posted([late if rank == 2 else FakeWork(done=True)])
    rec("recv" if first else "send", X, pp, peer, ("B", 0))
    rec.posted([never if rank == 1 else FakeWork(done=True)])
    for bucket in range(2 if rank == 1 else 1):  # rank 1's host ran ahead
        rec("all_reduce", X, dp, tag=("bucket", bucket))
        rec.posted([FakeWork()])
    late.done = True  # completes after later operations were issued
    return rec.snapshot()


def _report(tmp: Path) -> tuple[str, list[str]]:
    for rank in range(4):
        write_dump(dump_path(tmp, rank), {
            "reason": "test", "rank": rank, "world_size": 4, "sizes": SIZES,
            "coords": {"tp": 0, "pp": rank // 2, "dp": rank % 2}, "iteration": 2,
            "phase": "training", "job": "j"}, _rank_ops(rank))
    report = format_report(analyse({r: read_dump(dump_path(tmp, r)) for r in range(4)}), [])
    return report, [line.strip() for line in report.split("likely culprits:")[1].splitlines()[1:]]


def test_the_report_names_the_stuck_rank_not_the_one_behind_in_issue_order(tmp_path):
    report, culprits = _report(tmp_path)
    assert culprits == ["rank 3 (tp 0, pp 1, dp 1): behind its peers (pp messages 3 -> 1 #0) "
                        "while waiting for nobody: it stopped issuing operations (see its "
                        "stack)"], report
    rank1 = report.split("rank 1 (tp 0, pp 0, dp 1): ")[1].splitlines()[0]
    assert "stuck at [1] recv pp#0 from rank 3" in rank1 and "NOT COMPLETED" in rank1, report
    assert ("rank 0 waits in dp group [0, 1] #0 (all_reduce bucket0 [4] float32, iteration 3, "
            "-) for rank 1 (stuck earlier, at pp messages 3 -> 1 #0 (recv B0 [4] float32, "
            "iteration 3, -))") in report, report
    assert "rank 2 waits in dp group [2, 3] #0" in report and "rank 3 (has not issued it" \
        in report.split("rank 2 waits in")[1], report
