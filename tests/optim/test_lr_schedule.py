"""Learning-rate schedule: Megatron's warmup and decay, and flag conversion to samples."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from megatron3d.config import LRScheduleConfig, OptimizerConfig
from megatron3d.errors import ConfigError
from megatron3d.optim.lr_schedule import LRSchedule

MAX, MIN = 1e-3, 1e-5


def schedule(style: str, warmup: float = 100, decay: float = 1000) -> LRSchedule:
    return LRSchedule(max_lr=MAX, min_lr=MIN, warmup_samples=warmup, decay_samples=decay,
                      style=style)


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
def test_linear_warmup_from_zero(style):
    lr = schedule(style)
    assert lr.lr_at(0) == 0.0  # the first step of a warmed-up run has lr 0, as in Megatron
    assert lr.lr_at(25) == pytest.approx(2.5e-4)
    assert lr.lr_at(50) == pytest.approx(5e-4)
    assert lr.lr_at(100) == pytest.approx(MAX)


def test_no_warmup_starts_at_max():
    assert schedule("linear", warmup=0).lr_at(0) == MAX
    assert schedule("cosine", warmup=0).lr_at(0) == MAX


def test_linear_decay():
    lr = schedule("linear")
    assert lr.lr_at(101) == pytest.approx(MIN + (1 - 1 / 900) * (MAX - MIN))
    assert lr.lr_at(550) == pytest.approx(5.05e-4)  # halfway: 1e-5 + 0.5 * 9.9e-4
    assert lr.lr_at(775) == pytest.approx(MIN + 0.25 * (MAX - MIN))
    assert lr.lr_at(1000) == pytest.approx(MIN)


def test_cosine_decay():
    lr = schedule("cosine")
    assert lr.lr_at(550) == pytest.approx(5.05e-4)  # cos(pi/2) = 0: halfway too
    quarter = 0.5 * (math.cos(math.pi / 4) + 1)  # 0.853553...
    assert lr.lr_at(325) == pytest.approx(MIN + quarter * (MAX - MIN))
    assert lr.lr_at(325) == pytest.approx(8.5503e-4, rel=1e-4)
    assert lr.lr_at(1000) == pytest.approx(MIN)


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_min_lr_after_decay(style):
    lr = schedule(style)
    assert lr.lr_at(1001) == MIN
    assert lr.lr_at(10**9) == MIN


def test_constant_stays_at_max():
    lr = schedule("constant")
    assert lr.lr_at(101) == MAX
    assert lr.lr_at(10**9) == MAX


def test_pure_function_of_consumed():
    lr = schedule("cosine")
    forward = [lr.lr_at(c) for c in range(0, 1200, 37)]
    backward = [lr.lr_at(c) for c in reversed(range(0, 1200, 37))]
    assert forward == backward[::-1]


def opt(lr: float | None = MAX) -> OptimizerConfig:
    return OptimizerConfig(lr=lr, min_lr=MIN)


def _fixed(global_batch_size: int) -> Callable[[int], int]:
    """Samples consumed by n iterations without rampup."""
    return lambda iters: iters * global_batch_size


def test_iteration_flags_convert_with_the_global_batch():
    cfg = LRScheduleConfig(lr_decay_style="cosine", lr_warmup_iters=10, lr_decay_iters=100)
    lr = LRSchedule.from_config(opt(), cfg, train_samples=5000, samples_for_iters=_fixed(8),
                                iteration_based=True)
    assert lr == LRSchedule(max_lr=MAX, min_lr=MIN, warmup_samples=80, decay_samples=800,
                            style="cosine")
    assert lr.lr_at(40) == pytest.approx(MAX / 2)  # iteration 5 of warmup at 8 samples each


def test_decay_defaults_to_the_whole_run():
    it = LRSchedule.from_config(opt(), LRScheduleConfig(), train_samples=4096,
                                samples_for_iters=_fixed(32), iteration_based=True)
    samples = LRSchedule.from_config(opt(), LRScheduleConfig(lr_warmup_samples=64),
                                     train_samples=4096, samples_for_iters=_fixed(32),
                                     iteration_based=False)
    assert (it.warmup_samples, it.decay_samples) == (0, 4096)
    assert (samples.warmup_samples, samples.decay_samples) == (64, 4096)


def test_warmup_fraction_of_decay():
    cfg = LRScheduleConfig(lr_warmup_fraction=0.01, lr_decay_samples=300_000)
    lr = LRSchedule.from_config(opt(), cfg, train_samples=10**6, samples_for_iters=_fixed(512),
                                iteration_based=False)
    assert lr.warmup_samples == pytest.approx(3000)
    assert lr.decay_samples == 300_000
    iters = LRScheduleConfig(lr_warmup_fraction=0.1, lr_decay_iters=50)
    lr = LRSchedule.from_config(opt(), iters, train_samples=10**6, samples_for_iters=_fixed(16),
                                iteration_based=True)
    assert (lr.warmup_samples, lr.decay_samples) == (pytest.approx(80), 800)


@pytest.mark.parametrize(("cfg", "iteration_based", "flag"), [
    (LRScheduleConfig(lr_decay_samples=10), True, "--lr-decay-samples"),
    (LRScheduleConfig(lr_warmup_samples=10), True, "--lr-warmup-samples"),
    (LRScheduleConfig(lr_decay_iters=10), False, "--lr-decay-iters"),
    (LRScheduleConfig(lr_warmup_iters=10), False, "--lr-warmup-iters"),
    (LRScheduleConfig(lr_warmup_iters=10, lr_warmup_fraction=0.1), True, "--lr-warmup-fraction"),
])
def test_flags_of_the_wrong_unit_are_rejected(cfg, iteration_based, flag):
    with pytest.raises(ConfigError, match=flag):
        LRSchedule.from_config(opt(), cfg, train_samples=1000, samples_for_iters=_fixed(8),
                               iteration_based=iteration_based)


def test_missing_lr():
    with pytest.raises(ConfigError, match="--lr is required"):
        LRSchedule.from_config(opt(None), LRScheduleConfig(), 100, _fixed(8), True)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"warmup_samples": 1000}, "shorter than the decay"),
    ({"warmup_samples": -1}, "must be >= 0"),
    ({"decay_samples": 0}, "decay length must be > 0"),
    ({"min_lr": 2e-3}, "--min-lr"),
    ({"style": "exponential"}, "--lr-decay-style"),
])
def test_invalid_schedules(kwargs, match):
    args = {"max_lr": MAX, "min_lr": MIN, "warmup_samples": 100, "decay_samples": 1000,
            "style": "linear", **kwargs}
    with pytest.raises(ConfigError, match=match):
        LRSchedule(**args)
