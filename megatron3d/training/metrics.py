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
"""

from __future__ import annotations

import torch

LM_LOSS = "lm loss"
GRAD_NORM = "grad norm"
NUM_ZEROS = "num zeros"
LOSS_SCALE = "loss scale"
SKIPPED = "skipped iterations"
NAN = "nan iterations"
STEPS = "steps"

# Slots of the single accumulator buffer.
_LOSS_SUM, _VALID, _SKIPPED, _NAN, _GRAD_NORM, _NUM_ZEROS = range(6)
_SLOTS = 6


class IntervalMetrics:
    """Accumulates one log interval's step results on ``device``; reset by ``collect``."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._acc = torch.zeros(_SLOTS, dtype=torch.float32, device=device)  # [slots]
        self._steps = 0
        self._loss_scale = 1.0
        self._have_grad_norm = False
        self._have_num_zeros = False

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
        if grad_norm is not None:
            self._acc[_GRAD_NORM].copy_(self._f32(grad_norm))
        if num_zeros is not None:
            self._acc[_NUM_ZEROS].copy_(self._f32(num_zeros))
        self._have_grad_norm = grad_norm is not None
        self._have_num_zeros = num_zeros is not None
        self._steps += 1

    def collect(self) -> dict[str, float]:
        """Return the interval's metrics with one host transfer, then reset.

        Keys: ``steps``, ``skipped iterations``, ``nan iterations``, ``loss scale`` always
        (once a step was added); ``lm loss`` when some step was neither skipped nor NaN;
        ``grad norm`` / ``num zeros`` when the last step provided them.
        """
        values = self._acc.tolist()  # the single device -> host sync of the interval
        steps = self._steps
        result = {STEPS: float(steps), SKIPPED: values[_SKIPPED], NAN: values[_NAN]}
        if steps:
            result[LOSS_SCALE] = self._loss_scale
        if values[_VALID] > 0:
            result[LM_LOSS] = values[_LOSS_SUM] / values[_VALID]
        if steps and self._have_grad_norm:
            result[GRAD_NORM] = values[_GRAD_NORM]
        if steps and self._have_num_zeros:
            result[NUM_ZEROS] = values[_NUM_ZEROS]
        self._reset()
        return result

    def _reset(self) -> None:
        self._acc.zero_()
        self._steps = 0
        self._have_grad_norm = False
        self._have_num_zeros = False

    def _f32(self, value: torch.Tensor) -> torch.Tensor:
        return value.detach().to(device=self._device, dtype=torch.float32).reshape(())
