"""Iteration-based warmup and decay under --rampup-batch-size end at the iterations asked
for: the flags become the samples the ramp really consumes by then, not iters x final G."""

from __future__ import annotations

import pytest

from megatron3d.config import LRScheduleConfig, OptimizerConfig
from megatron3d.optim.batch_schedule import BatchSchedule
from megatron3d.optim.lr_schedule import LRSchedule
from tests.helpers.runs import learning_rates
from tests.helpers.tiny import ramp_argv

LR, MIN_LR = 1e-3, 1e-5
# G = 16 ramps 4 -> 8 -> 12 -> 16 over 48 samples: 4 + 8 + 8 + 12 + 12 + 16 ... per step.
RAMP = BatchSchedule(16, 2, 1, (4, 4, 48))


def _lr_per_iteration(lr: LRSchedule, batches: BatchSchedule, iters: int) -> list[float]:
    """lrs[i] is the learning rate of iteration i + 1 (it starts at the samples consumed)."""
    return [lr.lr_at(batches.samples_for_iters(i)) for i in range(iters + 1)]


@pytest.mark.parametrize("style", ["linear", "cosine"])
@pytest.mark.parametrize(("warmup", "decay"), [(4, None), (3, 9), (0, 5)])
def test_warmup_and_decay_end_at_their_iterations(style, warmup, decay):
    train_iters = 12
    cfg = LRScheduleConfig(lr_decay_style=style, lr_warmup_iters=warmup, lr_decay_iters=decay)
    lr = LRSchedule.from_config(OptimizerConfig(lr=LR, min_lr=MIN_LR), cfg,
                                RAMP.samples_for_iters(train_iters), RAMP.samples_for_iters,
                                iteration_based=True)
    lrs = _lr_per_iteration(lr, RAMP, train_iters)
    end = train_iters if decay is None else decay
    assert lrs[warmup] == LR  # exactly the peak once `warmup` iterations are done
    assert all(a < b for a, b in zip(lrs[:warmup], lrs[1:warmup + 1], strict=True))
    assert lrs[end] == MIN_LR  # exactly the floor once `end` iterations are done
    assert all(x > MIN_LR for x in lrs[warmup:end])
    assert all(x == MIN_LR for x in lrs[end:])


def test_without_rampup_iterations_are_final_batches():
    """No ramp: identical to the iters x global batch conversion (bitwise)."""
    flat = BatchSchedule(16, 2, 1)
    cfg = LRScheduleConfig(lr_decay_style="cosine", lr_warmup_iters=3, lr_decay_iters=9)
    lr = LRSchedule.from_config(OptimizerConfig(lr=LR, min_lr=MIN_LR), cfg, 12 * 16,
                                flat.samples_for_iters, iteration_based=True)
    assert lr == LRSchedule(max_lr=LR, min_lr=MIN_LR, warmup_samples=3 * 16,
                            decay_samples=9 * 16, style="cosine")


def test_the_trainer_reaches_peak_and_floor_on_time():
    """End to end: the learning rate the optimizer applied at each trained iteration."""
    argv = ramp_argv("gpt2", 8, ("16", "4", "4", "48"), "--lr-warmup-iters", "3",
                     "--lr-decay-iters", "6", "--lr", str(LR), "--min-lr", str(MIN_LR))
    used = learning_rates(argv)
    assert len(used) == 8
    assert used[0] == 0.0 and 0 < used[1] < used[2] < LR  # warmup: iterations 1-3
    assert used[3] == LR  # iteration 4 starts after 3 warmup iterations
    assert LR > used[4] > used[5] > MIN_LR and used[6:] == [MIN_LR, MIN_LR]
