"""Batch-size rampup: hand-worked sequences, validation messages and run-length walking."""

from __future__ import annotations

import random

import pytest

from megatron3d.config import TrainingConfig
from megatron3d.errors import ConfigError
from megatron3d.optim.batch_schedule import BatchSchedule

# START=4 INCR=4 SAMPLES=64 G=16: 3 increments, one every 64/3 = 21.33 samples, so the size
# becomes 8 at consumed 22 (ceil 21.33), 12 at 43 (ceil 42.67) and 16 at 64.
RAMP = BatchSchedule(global_batch_size=16, micro_batch_size=2, dp_size=2, rampup=(4, 4, 64))
# Walked by hand: each iteration consumes the size at its start.
#   consumed 0 4 8 12 16 20 -> size 4 | 24 32 40 -> 8 | 48 60 -> 12 | 72 88 ... -> 16
HAND_SIZES = [4, 4, 4, 4, 4, 4, 8, 8, 8, 12, 12, 16, 16, 16]
HAND_CONSUMED = [0, 4, 8, 12, 16, 20, 24, 32, 40, 48, 60, 72, 88, 104]


def megatron_float_reference(consumed: int) -> int:
    """Megatron's own float formulation of the ramp, for comparison."""
    start, incr, samples = 4, 4, 64
    per_increment = samples / ((16 - start) / incr)
    if consumed > samples:
        return 16
    return start + int(consumed / per_increment) * incr


def test_hand_worked_sequence():
    consumed, sizes, starts = 0, [], []
    for _ in HAND_SIZES:
        starts.append(consumed)
        sizes.append(RAMP.global_batch_size_at(consumed))
        consumed += sizes[-1]
    assert sizes == HAND_SIZES
    assert starts == HAND_CONSUMED


def test_boundaries_of_each_increment():
    assert [RAMP.global_batch_size_at(c) for c in (21, 22, 42, 43, 63, 64, 65)] == [
        4, 8, 8, 12, 12, 16, 16]


def test_matches_megatron_float_formula():
    for consumed in range(0, 200):
        assert RAMP.global_batch_size_at(consumed) == megatron_float_reference(consumed)


def test_num_micro_batches_follow_the_size():
    # micro 2 x dp 2 = 4 samples per micro-batch step.
    assert [RAMP.num_micro_batches_at(c) for c in (0, 22, 43, 64, 10**9)] == [1, 2, 3, 4, 4]


def test_ramp_sizes_include_final():
    assert RAMP.ramp_sizes() == [4, 8, 12, 16]


def test_position_is_pure_function_of_consumed():
    points = list(range(0, 120))
    expected = [RAMP.global_batch_size_at(c) for c in points]
    random.Random(0).shuffle(points)
    shuffled = {c: RAMP.global_batch_size_at(c) for c in points}
    assert [shuffled[c] for c in range(0, 120)] == expected
    copy = BatchSchedule(16, 2, 2, (4, 4, 64))
    assert all(copy.global_batch_size_at(c) == RAMP.global_batch_size_at(c) for c in points)


@pytest.mark.parametrize("rampup", [None, (16, 4, 64), (16, 0, 0)])
def test_no_ramp(rampup):
    schedule = BatchSchedule(16, 2, 2, rampup)
    assert {schedule.global_batch_size_at(c) for c in (0, 1, 64, 10**6)} == {16}
    assert schedule.ramp_sizes() == [16]
    assert schedule.num_micro_batches_at(0) == 4
    assert schedule.samples_for_iters(5) == 80
    assert schedule.iters_for_samples(90) == 5


def test_samples_for_iters_walks_the_ramp():
    for iters, consumed in enumerate(HAND_CONSUMED):
        assert RAMP.samples_for_iters(iters) == consumed
    assert RAMP.samples_for_iters(100) == 72 + (100 - 11) * 16


def test_iters_for_samples_drops_partial_last_batch():
    assert RAMP.iters_for_samples(0) == 0
    assert RAMP.iters_for_samples(3) == 0
    assert RAMP.iters_for_samples(4) == 1
    assert RAMP.iters_for_samples(71) == 10
    assert RAMP.iters_for_samples(72) == 11
    assert RAMP.iters_for_samples(87) == 11
    assert RAMP.iters_for_samples(88) == 12


def test_iters_and_samples_are_consistent():
    schedule = BatchSchedule(2048, 1, 16, (16, 16, 5_000))
    for samples in [0, 15, 16, 100, 4_999, 5_000, 5_001, 10**6 + 7]:
        iters = schedule.iters_for_samples(samples)
        assert schedule.samples_for_iters(iters) <= samples < schedule.samples_for_iters(iters + 1)
    for iters in range(0, 400, 7):
        assert schedule.iters_for_samples(schedule.samples_for_iters(iters)) == iters


def test_walk_matches_step_by_step_loop():
    schedule = BatchSchedule(96, 2, 3, (6, 18, 1000))
    consumed = 0
    for iters in range(200):
        assert schedule.samples_for_iters(iters) == consumed
        consumed += schedule.global_batch_size_at(consumed)


def test_from_config_defaults_global_batch_to_micro_times_dp():
    cfg = TrainingConfig(micro_batch_size=4, train_iters=10)
    assert BatchSchedule.from_config(cfg, dp_size=8).global_batch_size == 32
    ramped = TrainingConfig(micro_batch_size=2, global_batch_size=16, rampup_batch_size=(4, 4, 64))
    assert BatchSchedule.from_config(ramped, dp_size=2) == RAMP


def error_of(*args) -> str:
    with pytest.raises(ConfigError) as info:
        BatchSchedule(*args)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_incr_must_divide_ramp():
    message = error_of(16, 1, 1, (4, 5, 64))
    assert "--rampup-batch-size 4 5 64" in message
    assert "INCR 5 does not divide G - START = 12" in message
    assert "1, 2, 3, 4, 6, 12" in message


def test_start_above_final():
    assert "START 32 exceeds" in error_of(16, 1, 1, (32, 4, 64))


def test_negative_samples():
    assert "SAMPLES must be >= 0" in error_of(16, 1, 1, (4, 4, -1))


@pytest.mark.parametrize("incr", [0, -4])
def test_incr_must_be_positive_with_a_ramp(incr):
    assert "INCR must be > 0" in error_of(16, 1, 1, (4, incr, 64))


def test_zero_samples_with_a_ramp():
    assert "SAMPLES must be > 0" in error_of(16, 1, 1, (4, 4, 0))


def test_ramp_size_not_divisible_lists_offenders_and_choices():
    message = error_of(16, 2, 4, (4, 4, 64))
    assert "size(s) 4, 12 not divisible" in message
    assert "--micro-batch-size 2 x data-parallel size 4 = 8" in message
    assert "valid sizes from 4 to 16: 8, 16" in message
    assert "--rampup-batch-size" in message


def test_final_size_not_divisible_without_ramp():
    message = error_of(10, 4, 1, None)
    assert "--global-batch-size" in message
    assert "size(s) 10 not divisible" in message
    assert "valid sizes from 10 to 10: none" in message


@pytest.mark.parametrize("args", [(16, 0, 1, None), (16, 1, 0, None), (0, 1, 1, None),
                                  (16, 1, 1, (0, 4, 64))])
def test_non_positive_sizes(args):
    assert "must be > 0" in error_of(*args)


def test_validate_can_be_called_again():
    RAMP.validate()
