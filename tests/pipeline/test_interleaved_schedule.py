"""The interleaved 1F1B programs run together in the simulator: every (micro-batch, chunk)
forward and backward once, transfers paired with the right message around the ring, the
bubble of the paper, a bounded number of chunk activations in flight; the simulator rejects
corrupted programs and the layout rules are one line each."""

from __future__ import annotations

import dataclasses

import pytest

from megatron3d.config import ParallelConfig
from megatron3d.errors import ConfigError
from megatron3d.pipeline.instructions import Backward, Exchange, Forward
from megatron3d.pipeline.interleaved import (
    check_interleaving,
    interleaved_1f1b,
    interleaved_forward_only,
)
from megatron3d.pipeline.schedule import one_f_one_b
from megatron3d.pipeline.simulate import ScheduleError, SimulationReport, simulate

CASES = [(p, v, m) for p in (2, 3, 4, 8) for v in (2, 3, 4) for m in (p, 2 * p, 3 * p)]


def run(p: int, v: int, m: int) -> SimulationReport:
    return simulate([interleaved_1f1b(p, r, m, v) for r in range(p)], chunks=v)


@pytest.mark.parametrize(("p", "v", "m"), CASES)
def test_every_chunk_of_every_micro_batch_runs_once(p: int, v: int, m: int) -> None:
    report = run(p, v, m)
    everything = sorted((mb, c) for mb in range(m) for c in range(v))
    for stage in report.stages:
        forwards = [(i.micro_batch, i.chunk) for i in stage.order if isinstance(i, Forward)]
        backwards = [(i.micro_batch, i.chunk) for i in stage.order if isinstance(i, Backward)]
        assert sorted(forwards) == everything and sorted(backwards) == everything
        for c in range(v):  # each chunk sees the micro-batches in order, both ways
            assert [mb for mb, k in forwards if k == c] == list(range(m))
            assert [mb for mb, k in backwards if k == c] == list(range(m))


@pytest.mark.parametrize(("p", "v", "m"), CASES)
def test_bubble_is_the_papers_and_below_plain_1f1b(p: int, v: int, m: int) -> None:
    """Forward 1 and backward 2 units per chunk (a chunk is 1/v of a stage): the idle share
    is (p - 1) / (v * m) of the busy time, v times less than 1F1B's at the same p and m."""
    report = simulate([interleaved_1f1b(p, r, m, v) for r in range(p)], chunks=v)
    ideal = (p - 1) / (v * m)
    assert report.bubble_fraction == pytest.approx(ideal / (1 + ideal))
    plain = simulate([one_f_one_b(p, r, m) for r in range(p)])
    assert report.bubble_fraction < plain.bubble_fraction


@pytest.mark.parametrize(("p", "v", "m"), CASES)
def test_chunk_activations_in_flight_are_bounded(p: int, v: int, m: int) -> None:
    """Rank r holds at most 2 (p - r - 1) + (v - 1) p + 1 chunk activations (every one when
    m = p, where the schedule runs all forwards first)."""
    peaks = [stage.peak_activations for stage in run(p, v, m).stages]
    assert peaks == [m * v if m == p else 2 * (p - r - 1) + (v - 1) * p + 1 for r in range(p)]


@pytest.mark.parametrize(("p", "v", "m"), CASES)
def test_forward_only(p: int, v: int, m: int) -> None:
    programs = [interleaved_forward_only(p, r, m, v) for r in range(p)]
    assert not any(isinstance(i, Backward) for program in programs for i in program)
    report = simulate(programs, chunks=v)
    assert all(len(stage.order) == m * v for stage in report.stages)


def test_the_last_rank_feeds_the_first_rank_the_next_chunk() -> None:
    last, first = interleaved_1f1b(2, 1, 4, 2), interleaved_1f1b(2, 0, 4, 2)
    sends = [x for x in last if isinstance(x, Exchange) and x.send_forward is not None]
    assert sends[0].chunks[0] == 0  # chunk 0 of rank 1 ...
    receives = [x for x in first if isinstance(x, Exchange) and x.recv_forward is not None]
    assert receives[0].chunks[1] == 1  # ... is chunk 1's input on rank 0


def _relabel_first_receive(program: list) -> list:
    """The first receive of an activation names the wrong chunk."""
    out, done = [], False
    for step in program:
        if isinstance(step, Exchange) and step.recv_forward is not None and not done:
            chunks = list(step.chunks)
            chunks[1] += 1
            step, done = dataclasses.replace(step, chunks=tuple(chunks)), True
        out.append(step)
    return out


@pytest.mark.parametrize(("corrupt", "message"), [
    (_relabel_first_receive, "mis-paired|never used|deadlock"),
    (lambda prog: [s for i, s in enumerate(prog) if i != 3], "deadlock|before computing"),
    (lambda prog: [Backward(s.micro_batch, 1 - s.chunk) if isinstance(s, Backward) else s
                   for s in prog], "deadlock|mis-paired|Forward has not run"),
])
def test_corrupted_programs_are_rejected(corrupt, message: str) -> None:
    programs = [interleaved_1f1b(2, r, 4, 2) for r in range(2)]
    programs[1] = corrupt(programs[1])
    with pytest.raises(ScheduleError, match=message):
        simulate(programs, chunks=2)


def _parallel(**kwargs) -> ParallelConfig:
    return ParallelConfig(pipeline_model_parallel_size=kwargs.pop("pp", 2), **kwargs)


@pytest.mark.parametrize(("parallel", "layers", "micro_batches", "message"), [
    (_parallel(virtual_pipeline_model_parallel_size=2), 4, [4, 5], "multiples of PP = 2, got 5"),
    (_parallel(pp=1, virtual_pipeline_model_parallel_size=2), 4, [4], "needs pipeline"),
    (_parallel(virtual_pipeline_model_parallel_size=2, pipeline_schedule="gpipe"), 4, [4],
     "is a 1F1B schedule"),
    (_parallel(virtual_pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1),
     4, [4], "give one of them"),
    (_parallel(num_layers_per_virtual_pipeline_stage=2), 6, [4], "multiple of PP x 2 = 4"),
])
def test_layout_rules(parallel: ParallelConfig, layers: int, micro_batches: list[int],
                      message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_interleaving(parallel, layers, micro_batches)
    check_interleaving(_parallel(), layers, micro_batches)  # no interleaving: no rule
