"""Per-step training metrics kept on the device until the log interval.

``add_step`` only issues device kernels (no ``.item()``), so the training loop never waits
for the device between log lines; ``collect`` does the interval's single host transfer.

Counting rules: a skipped iteration is one the optimizer did not apply because the global
gradient norm was NaN or Inf (in fp16, a loss-scale overflow). A NaN iteration is one whose
loss is not finite, or a bf16/fp32 step skipped for its grad norm (once, even when both
hold); an fp16 overflow is routine and counts as skipped only. ``lm loss`` is the mean over
the interval's steps that were neither, which is Megatron's average over advanced iterations
with non-finite losses kept out of the sum.
Grad norm, num zeros and loss scale are the last step's values, as Megatron prints them.
``take`` hands an interval over without a sync, so intervals written to TensorBoard between
two log lines are transferred together at the next one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LM_LOSS = "lm loss"
GRAD_NORM = "grad norm"
NUM_ZEROS = "num zeros"
PARAMS_NORM = "params norm"
LOSS_SCALE = "loss scale"
SKIPPED = "skipped iterations"
NAN = "nan iterations"
STEPS = "steps"

# Slots of the single accumulator buffer.
_LOSS_SUM, _VALID, _SKIPPED, _NAN, _GRAD_NORM, _NUM_ZEROS, _PARAMS_NORM = range(7)
_SLOTS = 7


@dataclass(frozen=True)
class TakenInterval:
    """One interval's accumulators, still on the device, and what the host knew of it."""

    acc: torch.Tensor  # [slots], a copy
    steps: int
    loss_scale: float
    have: frozenset[str]  # which of GRAD_NORM, NUM_ZEROS, PARAMS_NORM the interval holds

    def values(self, host: list[float] | None = None) -> dict[str, float]:
        """The interval's metrics from ``host`` (``acc`` already transferred, e.g. several
        intervals stacked into one transfer), or with a transfer of its own.

        Keys: ``steps``, ``skipped iterations``, ``nan iterations``, ``loss scale`` always
        (once a step was added); ``lm loss`` when some step was neither skipped nor NaN;
        ``grad norm`` / ``num zeros`` when the last step provided them; ``params norm`` when
        one was given.
        """
        values = self.acc.tolist() if host is None else host
        result = {STEPS: float(self.steps), SKIPPED: values[_SKIPPED], NAN: values[_NAN]}
        if self.steps:
            result[LOSS_SCALE] = self.loss_scale
        if values[_VALID] > 0:
            result[LM_LOSS] = values[_LOSS_SUM] / values[_VALID]
        slots = {GRAD_NORM: _GRAD_NORM, NUM_ZEROS: _NUM_ZEROS, PARAMS_NORM: _PARAMS_NORM}
        result.update((key, values[slot]) for key, slot in slots.items()
                      if self.steps and key in self.have)
        return result


class IntervalMetrics:
    """Accumulates one interval's step results on ``device``; reset by ``take``/``collect``."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._acc = torch.zeros(_SLOTS, dtype=torch.float32, device=device)  # [slots]
        self._steps = 0
        self._loss_scale = 1.0
        self._have: set[str] = set()

    @property
    def steps(self) -> int:
        """Steps added since the last ``collect`` (host-side count, no sync)."""
        return self._steps

    def add_step(self, loss: torch.Tensor, grad_norm: torch.Tensor | None,
                 num_zeros: torch.Tensor | None, skipped: torch.Tensor,
                 loss_scale: float, *, nan_grad: torch.Tensor) -> None:
        """Record one optimizer step: 0-dim device tensors, and the host-side loss scale.
        ``nan_grad`` is ``StepStats.nan``: 1.0 if skipped for a non-finite grad norm."""
        loss = self._f32(loss)
        finite = torch.isfinite(loss)
        skip = self._f32(skipped) != 0
        nan = ~finite | (self._f32(nan_grad) != 0)
        valid = finite & ~skip
        sums = torch.stack([
            torch.where(valid, loss, torch.zeros_like(loss)),
            valid.float(), skip.float(), nan.float(),
        ])
        self._acc[_LOSS_SUM:_NAN + 1].add_(sums)
        self._loss_scale = loss_scale
        self._have.discard(PARAMS_NORM)
        for key, slot, value in ((GRAD_NORM, _GRAD_NORM, grad_norm),
                                 (NUM_ZEROS, _NUM_ZEROS, num_zeros)):
            if value is None:
                self._have.discard(key)
            else:
                self._acc[slot].copy_(self._f32(value))
                self._have.add(key)
        self._steps += 1

    def set_params_norm(self, norm: torch.Tensor) -> None:
        """The parameters' norm after the interval's last step (``--log-params-norm``)."""
        self._acc[_PARAMS_NORM].copy_(self._f32(norm))
        self._have.add(PARAMS_NORM)

    def take(self) -> TakenInterval:
        """The interval so far, without a host sync; then reset."""
        taken = TakenInterval(self._acc.clone(), self._steps, self._loss_scale,
                              frozenset(self._have))
        self._acc.zero_()
        self._steps = 0
        self._have.clear()
        return taken

    def collect(self) -> dict[str, float]:
        """The interval's metrics with one host transfer (``TakenInterval.values``), then
        reset."""
        return self.take().values()

    def _f32(self, value: torch.Tensor) -> torch.Tensor:
        return value.detach().to(device=self._device, dtype=torch.float32).reshape(())
