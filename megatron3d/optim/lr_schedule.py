"""Learning rate as a pure function of consumed samples (Megatron's annealing schedule).

Every length is in samples, so a resumed run only needs its consumed samples. Iteration
flags (``--lr-warmup-iters``, ``--lr-decay-iters``, and ``--train-iters`` as the default decay)
become the samples the batch schedule really consumes by that iteration, so with
``--rampup-batch-size`` warmup still ends at iteration ``--lr-warmup-iters`` and decay at
``--lr-decay-iters`` (Megatron instead refuses rampup with iteration-based schedules; without
rampup both are ``iters * global batch size``). With W = warmup and D = decay samples:

    consumed <= W (and W > 0):  lr = max_lr * consumed / W      (linear warmup from 0)
    constant style:             lr = max_lr
    consumed > D:               lr = min_lr
    otherwise, ratio = (consumed - W) / (D - W):
        linear:  coeff = 1 - ratio
        cosine:  coeff = 0.5 * (cos(pi * ratio) + 1)
        lr = min_lr + coeff * (max_lr - min_lr)

An iteration uses ``lr_at(consumed samples at its start)``, so as in Megatron the first step
of a run with warmup has learning rate 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from megatron3d.config import LRDecayStyle, LRScheduleConfig, OptimizerConfig
from megatron3d.errors import ConfigError

_STYLES = ("constant", "linear", "cosine")


_SHAPING_CONSTANT = {"max_lr": "--lr", "warmup_samples": "warmup samples",
                     "style": "--lr-decay-style"}
_SHAPING = {**_SHAPING_CONSTANT, "min_lr": "--min-lr", "decay_samples": "decay samples"}


@dataclass(frozen=True)
class LRSchedule:
    """Warmup then decay, lengths in samples; validated on creation."""

    max_lr: float
    min_lr: float
    warmup_samples: float
    decay_samples: float
    style: LRDecayStyle = "linear"

    def __post_init__(self) -> None:
        if self.style not in _STYLES:
            raise ConfigError(f"--lr-decay-style {self.style!r} is unknown; use one of {_STYLES}")
        if not 0.0 <= self.min_lr <= self.max_lr:
            raise ConfigError(f"--min-lr {self.min_lr} must be in [0, --lr {self.max_lr}]")
        if self.decay_samples <= 0:
            raise ConfigError(f"lr decay length must be > 0 samples, got {self.decay_samples}; "
                              f"set --lr-decay-iters/--lr-decay-samples or the run length")
        if not 0 <= self.warmup_samples < self.decay_samples:
            raise ConfigError(
                f"lr warmup ({self.warmup_samples} samples) must be >= 0 and shorter than the "
                f"decay ({self.decay_samples} samples); shorten --lr-warmup-* or lengthen "
                f"--lr-decay-*")

    def differences(self, other: LRSchedule) -> list[str]:
        """Where ``other`` gives another learning-rate curve, as "what: mine vs other" (the
        decay length and --min-lr do not shape a constant schedule)."""
        shaping = _SHAPING if self.style != "constant" or other.style != "constant" \
            else _SHAPING_CONSTANT
        return [f"{name}: {getattr(self, key)!r} vs {getattr(other, key)!r}"
                for key, name in shaping.items() if getattr(self, key) != getattr(other, key)]

    def lr_at(self, consumed_samples: int) -> float:
        """Learning rate of the iteration starting at ``consumed_samples``."""
        if self.warmup_samples > 0 and consumed_samples <= self.warmup_samples:
            return self.max_lr * consumed_samples / self.warmup_samples
        if self.style == "constant":
            return self.max_lr
        if consumed_samples > self.decay_samples:
            return self.min_lr
        ratio = (consumed_samples - self.warmup_samples) / (
            self.decay_samples - self.warmup_samples)
        coeff = 1.0 - ratio if self.style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    @classmethod
    def from_config(cls, optimizer_cfg: OptimizerConfig, lr_cfg: LRScheduleConfig,
                    train_samples: int, samples_for_iters: Callable[[int], int],
                    iteration_based: bool) -> LRSchedule:
        """Build the schedule from flags, converting iteration flags to samples.

        ``train_samples`` is what the whole run consumes: the default decay length.
        ``samples_for_iters(n)`` is what the first n iterations consume (the batch schedule's
        exact walk through any rampup), so an iteration flag lands on that iteration.
        ``--lr-warmup-fraction`` is a fraction of the decay length in samples. Flags of the
        other unit than the run's are rejected rather than ignored.
        """
        if optimizer_cfg.lr is None:
            raise ConfigError("--lr is required: set the peak learning rate, e.g. --lr 6e-4")
        _reject_mixed_units(lr_cfg, iteration_based)
        if iteration_based:
            decay = train_samples if lr_cfg.lr_decay_iters is None else samples_for_iters(
                lr_cfg.lr_decay_iters)
            warmup = samples_for_iters(lr_cfg.lr_warmup_iters)
        else:
            decay = train_samples if lr_cfg.lr_decay_samples is None else lr_cfg.lr_decay_samples
            warmup = lr_cfg.lr_warmup_samples
        if lr_cfg.lr_warmup_fraction is not None:
            warmup = lr_cfg.lr_warmup_fraction * decay
        return cls(max_lr=optimizer_cfg.lr, min_lr=optimizer_cfg.min_lr, warmup_samples=warmup,
                   decay_samples=decay, style=lr_cfg.lr_decay_style)


def _reject_mixed_units(lr_cfg: LRScheduleConfig, iteration_based: bool) -> None:
    """Megatron refuses sample flags in an iteration run (and vice versa); so do we."""
    if iteration_based:
        wrong = {"--lr-decay-samples": lr_cfg.lr_decay_samples is not None,
                 "--lr-warmup-samples": lr_cfg.lr_warmup_samples != 0}
        fix = "use --lr-decay-iters/--lr-warmup-iters with --train-iters"
    else:
        wrong = {"--lr-decay-iters": lr_cfg.lr_decay_iters is not None,
                 "--lr-warmup-iters": lr_cfg.lr_warmup_iters != 0}
        fix = "use --lr-decay-samples/--lr-warmup-samples with --train-samples"
    bad = [flag for flag, is_set in wrong.items() if is_set]
    if bad:
        raise ConfigError(f"{', '.join(bad)} cannot be used in this run; {fix}")
    explicit = lr_cfg.lr_warmup_iters != 0 or lr_cfg.lr_warmup_samples != 0
    if lr_cfg.lr_warmup_fraction is not None and explicit:
        raise ConfigError("--lr-warmup-fraction and --lr-warmup-iters/--lr-warmup-samples are "
                          "exclusive; set only one of them")
