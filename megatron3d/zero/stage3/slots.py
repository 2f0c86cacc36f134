"""The buffers gathered ZeRO-3 units live in, allocated once at start.

A slot holds one full unit at a time: its parameters (model dtype) and their gradients (fp32,
accumulated by autograd or by the gradient hook; with a bf16 wire, a bf16 copy to send). The
reduce-scatter is in place: this rank's 1/DP of the sum lands in its own chunk of the buffer
sent (NCCL's in-place form), so no output buffer exists; with two levels (``hops.py``) the
second reduces that chunk in place again. Parameters are permanent views into
their unit's slot,
so a unit that is gathered again into the same slot is exactly where the tensors autograd
saved in forward expect it; no copy in or out is ever needed.
"""

from __future__ import annotations

import torch

from megatron3d.zero.stage3.hops import Flat


class Slot:
    def __init__(self, numel: int, dtype: torch.dtype, wire: torch.dtype,
                 device: torch.device) -> None:
        self.params = torch.zeros(numel, dtype=dtype, device=device)  # [unit numel]
        self.grads = torch.zeros(numel, dtype=torch.float32, device=device)
        self.wire = None if wire == torch.float32 else torch.empty(numel, dtype=wire,
                                                                   device=device)
        self.occupant: int | None = None
        self._pending: tuple | None = None  # (work, reduced view, local grads view)

    def nbytes(self) -> int:
        extra = 0 if self.wire is None else self.wire.nbytes
        return self.params.nbytes + self.grads.nbytes + extra

    def reduce_scatter(self, unit: int, numel: int, into: torch.Tensor, hops: Flat) -> None:
        """Average unit ``unit``'s gradients, this slot's first ``numel`` (the unit may
        already be released), over DP as ``hops`` travels them;
        this rank's 1/DP is added into ``into`` once the collectives complete (``drain``).
        The gradients (or their wire copy) are overwritten: the sum lands in this rank's
        chunk of them."""
        self.drain()
        grads = self.grads[:numel]
        grads.div_(hops.dp.size)
        if self.wire is not None:
            self.wire[:numel].copy_(grads)
            grads = self.wire[:numel]
        work, out = hops.reduce(unit, grads)
        self._pending = (work, out, into)

    def advance(self) -> None:
        """Post the pending reduction's next hop (``hops.Chain``), its first completed."""
        if self._pending is not None:
            self._pending[0].advance()

    def drain(self) -> None:
        """Finish the pending reduction (before the gradient buffer is reused, and at the end
        of a program)."""
        if self._pending is None:
            return
        work, out, into = self._pending
        if work is not None:
            work.wait()
        into.add_(out)
        self._pending = None
