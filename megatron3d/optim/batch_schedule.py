"""Global batch size as a pure function of consumed samples (Megatron's batch-size rampup).

``--rampup-batch-size START INCR SAMPLES`` with final size G = ``--global-batch-size``:
there are ``n = (G - START) / INCR`` increments spread evenly over SAMPLES samples, and

    gbs(consumed) = START + INCR * floor(consumed * n / SAMPLES)   while consumed <= SAMPLES
    gbs(consumed) = G                                              afterwards

This is Megatron's ``START + floor(consumed / samples_per_increment) * INCR`` computed in
exact integer arithmetic (Megatron divides floats; the two agree except where float rounding
would move a boundary by one sample). At ``consumed == SAMPLES`` the formula already gives G,
so the size never exceeds G. START == G (or no rampup) means a constant G.

Because the position is a function of ``consumed_samples`` only, resuming from a checkpoint
needs nothing but the consumed samples to land on the same batch size.

Run length: an iteration consumes the global batch size evaluated at its start.
``iters_for_samples`` keeps only whole iterations that fit in ``--train-samples`` (the run
never consumes more than it was asked for). That is exactly Megatron's
``train_samples // global_batch_size`` without rampup and Megatron's ramp walk followed by
``// G`` when the ramp ends inside the run; it differs only when ``--train-samples`` ends
inside the ramp, where Megatron runs the whole ramp anyway and then subtracts iterations.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron3d.config import TrainingConfig
from megatron3d.errors import ConfigError


@dataclass(frozen=True)
class BatchSchedule:
    """Global batch size and micro-batch count at any point of the run; validated on creation.

    global_batch_size: the final size G. micro_batch_size: samples per micro-batch per
    data-parallel rank. dp_size: data-parallel size. rampup: (START, INCR, SAMPLES) or None.
    """

    global_batch_size: int
    micro_batch_size: int
    dp_size: int
    rampup: tuple[int, int, int] | None = None

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def from_config(cls, training: TrainingConfig, dp_size: int) -> BatchSchedule:
        """The schedule of ``training``; G defaults to micro batch size x DP as in Megatron."""
        gbs = training.global_batch_size or training.micro_batch_size * dp_size
        rampup = tuple(training.rampup_batch_size) if training.rampup_batch_size else None
        return cls(gbs, training.micro_batch_size, dp_size, rampup)

    # -- position -------------------------------------------------------------------------

    @property
    def samples_per_micro_batch_step(self) -> int:
        """Samples one micro-batch contributes across all DP ranks (micro x dp)."""
        return self.micro_batch_size * self.dp_size

    @property
    def _ramping(self) -> bool:
        return self.rampup is not None and self.rampup[0] != self.global_batch_size

    def _num_increments(self) -> int:
        start, incr, _ = self.rampup
        return (self.global_batch_size - start) // incr

    def _increment_index(self, consumed_samples: int) -> int:
        """How many increments have been applied at ``consumed_samples`` (0..n)."""
        if not self._ramping:
            return 0
        n = self._num_increments()
        samples = self.rampup[2]
        if consumed_samples > samples:
            return n
        return consumed_samples * n // samples

    def global_batch_size_at(self, consumed_samples: int) -> int:
        """Global batch size of the iteration that starts at ``consumed_samples``."""
        if consumed_samples < 0:
            raise ValueError(f"consumed_samples must be >= 0, got {consumed_samples}")
        if not self._ramping:
            return self.global_batch_size
        start, incr, _ = self.rampup
        return start + incr * self._increment_index(consumed_samples)

    def num_micro_batches_at(self, consumed_samples: int) -> int:
        """Micro-batches each DP rank runs in the iteration starting at ``consumed_samples``."""
        return self.global_batch_size_at(consumed_samples) // self.samples_per_micro_batch_step

    def ramp_sizes(self) -> list[int]:
        """Every distinct global batch size of the run, in order, the final one included."""
        if not self._ramping:
            return [self.global_batch_size]
        start, incr, _ = self.rampup
        return list(range(start, self.global_batch_size + 1, incr))

    def _next_change(self, consumed_samples: int) -> int | None:
        """Smallest consumed count above ``consumed_samples`` where the size grows, or None."""
        if not self._ramping:
            return None
        k = self._increment_index(consumed_samples)
        n = self._num_increments()
        if k == n:
            return None
        samples = self.rampup[2]
        return -(-(k + 1) * samples // n)  # ceil((k + 1) * SAMPLES / n)

    # -- run length -----------------------------------------------------------------------

    def samples_for_iters(self, train_iters: int) -> int:
        """Samples consumed after ``train_iters`` iterations (exact, walking the ramp)."""
        if train_iters < 0:
            raise ValueError(f"train_iters must be >= 0, got {train_iters}")
        consumed, left = 0, train_iters
        while left > 0:
            gbs = self.global_batch_size_at(consumed)
            change = self._next_change(consumed)
            if change is None:
                return consumed + left * gbs
            steps = min(left, -(-(change - consumed) // gbs))
            consumed += steps * gbs
            left -= steps
        return consumed

    def iters_for_samples(self, train_samples: int) -> int:
        """Whole iterations that fit in ``train_samples`` (the partial last batch is dropped).

        Inverse of ``samples_for_iters`` in the sense that
        ``samples_for_iters(iters_for_samples(s)) <= s`` and one more iteration would exceed s.
        """
        if train_samples < 0:
            raise ValueError(f"train_samples must be >= 0, got {train_samples}")
        consumed, iters = 0, 0
        while True:
            gbs = self.global_batch_size_at(consumed)
            fit = (train_samples - consumed) // gbs
            change = self._next_change(consumed)
            if change is None:
                return iters + fit
            segment = -(-(change - consumed) // gbs)  # iterations starting before the change
            if fit < segment:
                return iters + fit
            consumed += segment * gbs
            iters += segment

    # -- validation -----------------------------------------------------------------------

    def validate(self) -> None:
        """Raise ``ConfigError`` (one line) unless every size of the run divides micro x dp."""
        if self.micro_batch_size <= 0:
            raise ConfigError(f"--micro-batch-size must be > 0, got {self.micro_batch_size}")
        if self.dp_size <= 0:
            raise ConfigError(f"data-parallel size must be > 0, got {self.dp_size}")
        if self.global_batch_size <= 0:
            raise ConfigError(f"--global-batch-size must be > 0, got {self.global_batch_size}")
        if self.rampup is None:
            self._check_divisible([self.global_batch_size], "--global-batch-size")
            return
        self._validate_ramp_shape()
        self._check_divisible(self.ramp_sizes(), "--rampup-batch-size")

    def _validate_ramp_shape(self) -> None:
        start, incr, samples = self.rampup
        g = self.global_batch_size
        flag = f"--rampup-batch-size {start} {incr} {samples} with --global-batch-size {g}"
        if start <= 0:
            raise ConfigError(f"{flag}: START must be > 0; set START to a positive batch size")
        if start > g:
            raise ConfigError(f"{flag}: START {start} exceeds the final global batch size; "
                              f"lower START or raise --global-batch-size")
        if samples < 0:
            raise ConfigError(f"{flag}: SAMPLES must be >= 0, got {samples}")
        if start == g:
            return
        if incr <= 0:
            raise ConfigError(f"{flag}: INCR must be > 0 when START < G, got {incr}")
        if (g - start) % incr:
            raise ConfigError(f"{flag}: INCR {incr} does not divide G - START = {g - start}; "
                              f"pick INCR among {_divisors(g - start)}")
        if samples == 0:
            raise ConfigError(f"{flag}: SAMPLES must be > 0 to ramp from {start} to {g}; "
                              f"set SAMPLES > 0 or START = {g}")

    def _check_divisible(self, sizes: list[int], flag: str) -> None:
        unit = self.samples_per_micro_batch_step
        bad = [s for s in sizes if s % unit]
        if not bad:
            return
        low = min(sizes)
        valid = list(range(-(-low // unit) * unit, self.global_batch_size + 1, unit))
        below = self.global_batch_size // unit * unit
        nearest = f"{below} or {below + unit}" if below else str(unit)
        raise ConfigError(
            f"{flag}: global batch size(s) {_join(bad)} not divisible by --micro-batch-size "
            f"{self.micro_batch_size} x data-parallel size {self.dp_size} = {unit}; "
            f"valid sizes from {low} to {self.global_batch_size}: "
            f"{_join(valid) or f'none, nearest {nearest}'} "
            f"(change {flag} or --micro-batch-size)")


def _divisors(n: int) -> str:
    return _join([d for d in range(1, n + 1) if n % d == 0])


def _join(values: list[int], limit: int = 12) -> str:
    """Comma-separated values, shortened in the middle so one-line messages stay short."""
    if len(values) > limit:
        head, tail = values[: limit - 2], values[-2:]
        return ", ".join(map(str, head)) + ", ..., " + ", ".join(map(str, tail))
    return ", ".join(map(str, values))
