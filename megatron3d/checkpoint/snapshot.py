"""The state a rank writes, copied to host memory without a second copy on the device.

A save needs the fp32 weights and Adam moments of the parts this rank owns (``chunks.py``:
its ZeRO slice, TP rank 0's replicated tensors, the first stage's tied copy; without ZeRO,
data-parallel rank 0 only). They are copied straight from the optimizer's live tensors into
one host buffer (pinned on GPUs, so each copy is a DMA the host need not wait for), allocated
once at the first save and reused, whose slices are the data of the rank's chunks: a rank
file then holds the buffer as one storage. No copy of the optimizer state is made on the
device (its finiteness check, ``MixedPrecisionOptimizer.state_not_finite``, reads it a piece
at a time), so a run that fits its steps fits its saves.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from megatron3d import device as devices
from megatron3d.checkpoint.chunks import KINDS, new_chunk, owned_parts
from megatron3d.mpu.meta import get_meta
from megatron3d.mpu.state import AxisGroup, ParallelState
from megatron3d.zero.shard import Shard

LiveState = Callable[[int, int], dict[str, torch.Tensor | None]]
"""(local offset, length) -> each kind's live fp32 values there (None: all zero)."""


class HostSnapshot:
    """The host buffer [kind, owned elements] and the chunks whose data are its slices, in
    ``chunks.owned_parts`` order (the order a same-layout load expects)."""

    def __init__(self, params: list[nn.Parameter], shard: Shard, state: ParallelState,
                 replicas: list[AxisGroup]) -> None:
        parts = list(owned_parts(params, shard, state, replicas))
        total = sum(end - start for _, start, end, _ in parts)
        self.device = shard.grads.device
        self._buffer = devices.host_buffer((len(KINDS), total), torch.float32)
        self._spans: list[tuple[int, int, int]] = []  # (local offset, buffer offset, length)
        self.chunks: list[dict] = []
        at = 0
        for p, start, end, local in parts:
            n = end - start
            self.chunks += [new_chunk(get_meta(p), kind, state.tp.rank, state.tp.size,
                                      tuple(p.shape), start, end, self._buffer[k, at:at + n])
                            for k, kind in enumerate(KINDS)]
            self._spans.append((local, at, n))
            at += n

    @property
    def nbytes(self) -> int:
        return self._buffer.nbytes

    def capture(self, live: LiveState) -> None:
        """Copy the owned parts of the live state in; returns once the copies are done (a
        device sync, at save time)."""
        for local, at, n in self._spans:
            values = live(local, n)
            for k, kind in enumerate(KINDS):
                target, source = self._buffer[k, at:at + n], values[kind]
                if source is None:
                    target.zero_()
                else:
                    target.copy_(source, non_blocking=True)
        devices.synchronize(self.device)

    def all_finite(self) -> bool:
        """Whether the captured state holds no NaN/Inf: a check of host memory, row by row
        (for a writer thread: no device work, no sync). A finite sum means every element is
        (a NaN or Inf would carry into it), and costs a read without a temporary; only a sum
        that is not finite (a bad element, or finite values that overflow) is checked
        element by element."""
        return all(bool(torch.isfinite(row.sum())) or bool(torch.isfinite(row).all())
                   for row in self._buffer)
