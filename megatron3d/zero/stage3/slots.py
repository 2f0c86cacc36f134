"""The buffers gathered ZeRO-3 units live in, allocated once at start.

A slot holds one full unit at a time: its parameters (model dtype) and their gradients (fp32,
accumulated by autograd or by the gradient hook; with a bf16 wire, a bf16 copy to send). The
reduce-scatter is in place: this rank's 1/DP of the sum lands in its own chunk of the buffer
sent (NCCL's in-place form), so no output buffer exists. Parameters are permanent views into
their unit's slot,
so a unit that is gathered again into the same slot is exactly where the tensors autograd
saved in forward expect it; no copy in or out is ever needed.
"""

from __future__ import annotations

import torch

from megatron3d.mpu import comm
from megatron3d.mpu.state import AxisGroup


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

    def reduce_scatter(self, numel: int, into: torch.Tensor, dp: AxisGroup) -> None:
        """Average this slot's first ``numel`` gradients over DP; this rank's 1/DP is added
        into ``into`` once the collective completes (``drain``). The gradients (or their wire
        copy) are overwritten: the sum lands in this rank's chunk of them."""
        self.drain()
        grads = self.grads[:numel]
        grads.div_(dp.size)
        if self.wire is not None:
            self.wire[:numel].copy_(grads)
            grads = self.wire[:numel]
        chunk = numel // dp.size
        out = grads[dp.rank * chunk:(dp.rank + 1) * chunk]
        self._pending = (comm.start_reduce_scatter(out, grads, dp, ("unit", self.occupant)),
                         out, into)

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
