"""Straggler naming (training/straggler.py): the rule on synthetic timings (noise, a
persistent straggler, a transient blip), and one 4-rank run where one rank spends 150 ms more
in each step's compute and is named within 20 steps, and nobody else is."""

from __future__ import annotations

import logging
import random
import time

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from benchmarks.straggler import SlowCompute, StragglerWarnings
from megatron3d.device import ComputeSpans
from megatron3d.training.build import Overrides
from megatron3d.training.straggler import PERSISTENCE, StragglerRule, slowdowns, stage_peers
from tests.helpers.dist import run_distributed
from tests.helpers.runs import build
from tests.helpers.tiny import train_argv

THRESHOLD = 0.2


def _named_per_window(windows: list[list[float]], peers: list[list[int]]) -> list[list[int]]:
    rule = StragglerRule(THRESHOLD)
    return [rule.judge(slowdowns(times, peers)) for times in windows]


def test_stage_peers_are_the_other_ranks_of_the_same_pipeline_stage():
    assert stage_peers(4, 1) == [[1, 2, 3], [0, 2, 3], [0, 1, 3], [0, 1, 2]]
    assert stage_peers(4, 2) == [[1], [0], [3], [2]]
    assert stage_peers(2, 2) == [[], []]
    assert slowdowns([1.0, 5.0], [[], []]) == [None, None]  # no peers: compared with nobody


def test_noise_names_nobody():
    """500 windows of 8 ranks whose times scatter by 5% (and a rare 30% blip) name nobody."""
    rng = random.Random(0)
    windows = [[0.1 * (1 + rng.gauss(0, 0.05)) * (1.3 if rng.random() < 0.01 else 1.0)
                for _ in range(8)] for _ in range(500)]
    assert not any(_named_per_window(windows, stage_peers(8, 1)))


def test_a_persistent_straggler_is_named_after_the_persistence_windows_and_each_after():
    windows = [[0.1, 0.1, 0.15, 0.1] for _ in range(6)]
    named = _named_per_window(windows, stage_peers(4, 1))
    assert named == [[]] * (PERSISTENCE - 1) + [[2]] * (6 - PERSISTENCE + 1)


def test_a_slowdown_below_the_threshold_is_not_named():
    windows = [[0.1, 0.115, 0.1, 0.1] for _ in range(10)]
    assert not any(_named_per_window(windows, stage_peers(4, 1)))


def test_a_transient_blip_is_not_named():
    """Slow for PERSISTENCE - 1 windows at a time, then back: the streak restarts each time."""
    blip = [[0.1, 0.3, 0.1, 0.1]] * (PERSISTENCE - 1) + [[0.1, 0.1, 0.1, 0.1]]
    assert not any(_named_per_window(blip * 5, stage_peers(4, 1)))


def test_stages_are_compared_apart():
    """The last stage computes the loss head and is slower than the first: not a straggler."""
    windows = [[0.1, 0.1, 0.2, 0.2] for _ in range(10)]
    assert not any(_named_per_window(windows, stage_peers(4, 2)))


def test_cpu_compute_time_counts_work_not_waiting():
    """On CPU a span is the thread's CPU time: blocked (as in a collective) it does not grow.
    Mutation: the wall clock counts the sleep."""
    spans = ComputeSpans(torch.device("cpu"))
    spans.begin()
    time.sleep(0.05)
    spans.end()
    spans.begin()
    SlowCompute(0.02).begin([])
    spans.end()
    waited, worked = spans.take()
    assert waited < 0.01 <= 0.02 <= worked
    assert spans.take() == []


def _train_with_slow_rank(slow_rank: int, iters: int, board: str) -> list[tuple[int, str]]:
    import torch.distributed as dist

    rank = dist.get_rank()
    observers = (SlowCompute(0.15),) if rank == slow_rank else ()
    warnings = StragglerWarnings()
    logger = logging.getLogger("megatron3d.training.straggler")
    logger.addHandler(warnings)

    def count(iteration: int, _result) -> None:
        warnings.iteration = iteration

    trainer, _ = build(train_argv("gpt2", iters, "--straggler-interval", "5",
                                  "--tensorboard-dir", board),
                       Overrides(observers=observers), on_step=count)
    try:
        trainer.run()
    finally:
        logger.removeHandler(warnings)
    return warnings.lines


def test_a_rank_slowed_by_150_ms_per_step_is_named_within_20_steps(tmp_path):
    """The slow rank burns 150 ms of CPU (the device here) per step. Mutation: the wall clock
    around the whole step counts the others' waits for the slow rank in the reductions, so
    every rank is as slow as it and nobody is named."""
    named = run_distributed(_train_with_slow_rank, 4, 3, 20, str(tmp_path))
    assert named[:3] == [[], [], []]
    assert named[3], "the slow rank was not named"
    first, message = named[3][0]
    assert first <= 20
    assert message.startswith("straggler: rank 3 on node ")
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    slowdowns = {rank: [e.value for e in events.Scalars(f"straggler slowdown rank {rank}")]
                 for rank in range(4)}  # each comparison's, written by the logging rank
    assert [len(series) for series in slowdowns.values()] == [4] * 4
    assert min(slowdowns[3]) > THRESHOLD
