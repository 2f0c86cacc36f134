"""Pipeline schedules run together in the simulator: they finish, pair every transfer with the
right micro-batch, respect dependencies and bound memory; and the simulator catches bad ones."""

from __future__ import annotations

import pytest

from megatron3d.errors import ConfigError
from megatron3d.pipeline.instructions import Backward, Exchange, Forward, Instruction
from megatron3d.pipeline.schedule import forward_only, gpipe, one_f_one_b, schedule_for
from megatron3d.pipeline.simulate import ScheduleError, SimulationReport, simulate

CASES = sorted({(s, m) for s in (1, 2, 3, 4, 8) for m in (1, s, 2 * s + 1, 4 * s)})
TRAINING = {"1f1b": one_f_one_b, "gpipe": gpipe}


def run(schedule, num_stages: int, num_micro_batches: int) -> SimulationReport:
    return simulate([schedule(num_stages, s, num_micro_batches) for s in range(num_stages)])


def times(report: SimulationReport, kind: type) -> dict[tuple[int, int], tuple[int, int]]:
    """(stage, micro-batch) -> (start, end) of every computation of ``kind``."""
    return {(s, e.instruction.micro_batch): (e.start, e.end)
            for s, stage in enumerate(report.stages) for e in stage.events
            if isinstance(e.instruction, kind)}


@pytest.mark.parametrize("name", TRAINING)
@pytest.mark.parametrize(("num_stages", "m"), CASES)
def test_training_schedule_runs_every_micro_batch_once_in_order(name: str, num_stages: int,
                                                                m: int) -> None:
    report = run(TRAINING[name], num_stages, m)
    for stage in report.stages:
        kinds = [(type(i), i.micro_batch) for i in stage.order]
        assert [mb for k, mb in kinds if k is Forward] == list(range(m))
        assert [mb for k, mb in kinds if k is Backward] == list(range(m))
    forward, backward = times(report, Forward), times(report, Backward)
    for s in range(num_stages):
        for mb in range(m):
            if s > 0:
                assert forward[s, mb][0] >= forward[s - 1, mb][1]
            if s < num_stages - 1:
                assert backward[s, mb][0] >= backward[s + 1, mb][1]
            assert backward[s, mb][0] >= forward[s, mb][1]


@pytest.mark.parametrize(("num_stages", "m"), CASES)
def test_memory_bound(num_stages: int, m: int) -> None:
    peaks = [st.peak_activations for st in run(one_f_one_b, num_stages, m).stages]
    assert peaks == [min(num_stages - s, m) for s in range(num_stages)]
    assert all(st.peak_activations == m for st in run(gpipe, num_stages, m).stages)


@pytest.mark.parametrize("name", TRAINING)
@pytest.mark.parametrize(("num_stages", "m"), CASES)
def test_no_bubble_beyond_the_pipeline_fill(name: str, num_stages: int, m: int) -> None:
    """With forward 1 and backward 2 units, both schedules take (m + S - 1) * 3 units."""
    report = run(TRAINING[name], num_stages, m)
    assert report.makespan == 3 * (m + num_stages - 1)
    assert report.bubble_fraction == pytest.approx((num_stages - 1) / (m + num_stages - 1))


@pytest.mark.parametrize("schedule", [one_f_one_b, gpipe, forward_only])
@pytest.mark.parametrize(("num_stages", "m"), CASES)
def test_edges_have_no_missing_neighbour_and_no_empty_exchange(schedule, num_stages: int,
                                                               m: int) -> None:
    for s in range(num_stages):
        steps = [i for i in schedule(num_stages, s, m) if isinstance(i, Exchange)]
        assert Exchange() not in steps
        if s == 0:
            assert all(x.recv_forward is None and x.send_backward is None for x in steps)
        if s == num_stages - 1:
            assert all(x.send_forward is None and x.recv_backward is None for x in steps)


def test_steady_state_combines_transfers() -> None:
    program = one_f_one_b(4, 1, 8)
    assert Exchange(send_forward=2, recv_backward=0) in program
    assert Exchange(send_backward=0, recv_forward=3) in program


@pytest.mark.parametrize(("num_stages", "m"), CASES)
def test_forward_only(num_stages: int, m: int) -> None:
    programs = [forward_only(num_stages, s, m) for s in range(num_stages)]
    assert not any(isinstance(i, Backward) for program in programs for i in program)
    report = simulate(programs)
    assert all(st.order == tuple(Forward(mb) for mb in range(m)) for st in report.stages)
    assert report.makespan == m + num_stages - 1


def test_schedule_for() -> None:
    assert schedule_for("1f1b", 4, 2, 8) == one_f_one_b(4, 2, 8)
    assert schedule_for("gpipe", 4, 2, 8) == gpipe(4, 2, 8)
    with pytest.raises(ConfigError, match="unknown pipeline schedule.*interleaved"):
        schedule_for("interleaved", 4, 2, 8)


@pytest.mark.parametrize(("args", "message"), [
    ((0, 0, 1), "at least one stage"),
    ((2, 2, 1), "stage 2 is outside 0..1"),
    ((2, -1, 1), "stage -1 is outside"),
    ((2, 0, 0), "at least one micro-batch"),
])
def test_invalid_inputs(args: tuple[int, int, int], message: str) -> None:
    for schedule in (one_f_one_b, gpipe, forward_only):
        with pytest.raises(ConfigError, match=message):
            schedule(*args)


def test_one_stage_is_plain_accumulation() -> None:
    assert one_f_one_b(1, 0, 2) == [Forward(0), Backward(0), Forward(1), Backward(1)]


# The simulator must be able to fail, or the tests above prove nothing.

def check_fails(programs: list[list[Instruction]], message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        simulate(programs)


def test_detects_deadlock() -> None:
    # Stage 0 waits for a gradient before sending the activation stage 1 waits for.
    check_fails([
        [Forward(0), Exchange(recv_backward=0), Backward(0), Exchange(send_forward=0)],
        [Exchange(recv_forward=0), Forward(0), Backward(0), Exchange(send_backward=0)],
    ], r"deadlock: stage 0 .*recv_backward\(0\).*stage 1 .*recv_forward\(0\)")


def test_detects_micro_batches_received_out_of_order() -> None:
    check_fails([
        forward_only(2, 0, 2),
        [Exchange(recv_forward=1), Forward(1), Exchange(recv_forward=0), Forward(0)],
    ], "stage 0 sends micro-batch 0 but stage 1 receives it as micro-batch 1")


def test_detects_backward_out_of_order_across_stages() -> None:
    last = one_f_one_b(2, 1, 2)
    swapped = [Backward(1 - i.micro_batch) if isinstance(i, Backward) else i for i in last]
    check_fails([one_f_one_b(2, 0, 2), swapped], "deadlock|mis-paired")


def test_detects_backward_without_forward() -> None:
    check_fails([[Backward(0)]], r"deadlock: stage 0 .*Backward.*its Forward has not run")


def test_detects_missing_input() -> None:
    check_fails([[Forward(0)], [Forward(0)]], "stage 1 .*input not received")


@pytest.mark.parametrize(("programs", "message"), [
    ([[Exchange()]], "empty Exchange"),
    ([[Exchange(send_forward=0)], []], r"send_forward\(0\) before computing it"),
    ([[Exchange(recv_forward=0)]], "has no stage -1"),
    ([[Forward(0), Forward(0)]], "twice"),
    ([forward_only(2, 0, 1), [Exchange(recv_forward=0)]], "never used"),
])
def test_detects_malformed_programs(programs: list[list[Instruction]], message: str) -> None:
    check_fails(programs, message)


def test_transfers_stay_posted_until_matched() -> None:
    # Stage 1 posts its receive long before stage 0 sends: it must still be matched.
    report = simulate([
        [Forward(0), Forward(1), Exchange(send_forward=0), Exchange(send_forward=1)],
        [Exchange(recv_forward=0), Forward(0), Exchange(recv_forward=1), Forward(1)],
    ])
    assert [e.start for e in report.stages[1].events] == [2, 3]
