"""Stop a run that no longer trains, rather than exit 0 and publish its dead state.

A diverged run (weights blown up by one step) gives a non-finite loss and gradient at every
later step; each is skipped, so the weights stay finite but useless and the run would carry
on to its end and save them as ``latest``. An fp16 loss scale that overflows every step skips
every step the same way. ``SkipWatch`` counts the skipped steps in a row on the device (two
kernels a step, no host sync) and is read where the loop syncs anyway, at each log line and
before each save:

- ``--max-skipped-iters-in-a-row`` steps skipped in a row stop the run (exit 1, nothing saved);
- a save is refused when its last steps were skipped with a non-finite loss, either
  ``PERSISTENT`` of them in a row or every step of this run after its first (``--lr 1e30``:
  step 1 ruins the weights, the rest are NaN): such weights no longer give a finite loss,
  and publishing them would hide the last good checkpoint. One NaN loss at a save of a
  long run is a bad batch, not a dead model: that save goes ahead (the skipped step left
  the weights as they were), and so does one of a run that applied no step (its weights
  are the ones it loaded: saving them again hides nothing; a damaged checkpoint that loads
  finite weights giving a NaN loss is not this rule's to find). Only the last pipeline
  stage sees the loss, so a save agrees on it over the world (saves sync anyway).

The skip flags are agreed by every rank (the optimizer decides them on the device), so every
rank raises at the same check and none is left waiting in a collective.
"""

from __future__ import annotations

import torch

from megatron3d.errors import TrainingError
from megatron3d.mpu import comm
from megatron3d.mpu.state import AxisGroup

PERSISTENT = 3
"""Non-finite losses in a row at a save that mean the weights, not a batch, are broken."""


class SkipWatch:
    """``add`` after every step, ``check`` at a log line or (``saving``) before a save."""

    def __init__(self, window: int, world: AxisGroup, device: torch.device) -> None:
        self.window, self.world = window, world  # window 0: never stops for skipped steps
        # [steps skipped in a row now, the longest such run since the last check, whether the
        # last step's loss was not finite]
        self._state = torch.zeros(3, device=device)
        self._steps = 0  # steps of this run, counted on the host: no sync


    def add(self, skipped: torch.Tensor, loss: torch.Tensor) -> None:
        """One step: ``skipped`` and ``loss`` are 0-dim device tensors."""
        skip = (skipped.detach().reshape(()) != 0).to(self._state.dtype)
        state = self._state
        self._steps += 1
        state[0] = (state[0] + 1) * skip
        state[1] = torch.maximum(state[1], state[0])
        state[2] = (~torch.isfinite(loss.detach().reshape(()))).to(state.dtype)

    def check(self, iteration: int, saving: bool = False) -> None:
        """Raise ``TrainingError`` on every rank if the run stopped training by ``iteration``
        (one host transfer; with ``saving``, every rank of the world calls it)."""
        state = comm.all_reduce(self._state.clone(), self.world, op=comm.MAX) if saving \
            else self._state
        run, longest, not_finite = state.tolist()
        self._state[1] = run
        if self.window and longest >= self.window:
            first = iteration - int(run) + 1 if run >= self.window else None
            where = (f"iterations {first} to {iteration}" if first is not None
                     else f"{int(longest)} iterations before iteration {iteration}")
            raise TrainingError(
                f"every step was skipped for {where} (non-finite gradients: the run diverged, "
                f"or an fp16 --loss-scale overflows every step; --max-skipped-iters-in-a-row "
                f"{self.window}): nothing more is saved; resume from the last good checkpoint "
                "with a lower --lr, or use dynamic loss scaling")
        changed = 0 < run < self._steps  # this run applied a step before the skipped ones
        if saving and not_finite and changed and (run >= PERSISTENT or run == self._steps - 1):
            raise TrainingError(
                f"the loss is not finite at the {int(run)} steps up to iteration {iteration}, "
                "each skipped: "
                "the weights no longer give a finite loss, so they are not saved; resume "
                "from the last good checkpoint with --load and a lower --lr")
