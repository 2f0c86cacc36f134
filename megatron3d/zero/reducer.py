"""Data-parallel gradient reduction in buckets, overlapped with the last backward pass
(ZeRO-0 and ZeRO-1).

Gradients accumulate locally over a step's micro-batches; only the last micro-batch's
backward produces final gradients. ``arm()`` is called just before that backward: from then
on, the buffers' gradient hook counts down each parameter's bucket, and a bucket whose last
gradient has arrived is divided by the DP size and reduced asynchronously while backward
continues with earlier layers. ``finish()`` reduces whatever did not complete (parameters
that got no gradient) and waits for everything.

ZeRO-0 all-reduces each bucket in place. ZeRO-1 reduce-scatters it, so each rank receives
only the averaged gradients of its own slice (``Shard``), which is all its optimizer needs.
With ``reduce_dtype`` bf16 the gradients travel in bf16 (half the bytes) through one wire
buffer allocated at start, and are summed back into fp32.
"""

from __future__ import annotations

import torch

from megatron3d.mpu import comm
from megatron3d.mpu.state import AxisGroup
from megatron3d.zero.buffers import FlatBuffers
from megatron3d.zero.shard import Shard


class GradReducer:
    def __init__(self, buffers: FlatBuffers, shard: Shard, dp: AxisGroup,
                 reduce_dtype: torch.dtype = torch.float32) -> None:
        self.buffers, self.shard, self.dp = buffers, shard, dp
        self._armed = False
        self._remaining: list[int] = []
        self._work: list = []
        self._launched: set[int] = set()
        self._wire = self._wire_out = None
        if reduce_dtype != torch.float32 and dp.size > 1:
            self._wire = torch.empty_like(buffers.grads, dtype=reduce_dtype)
            self._wire_out = (self._wire if shard.is_whole
                              else torch.empty_like(shard.grads, dtype=reduce_dtype))
        if dp.size > 1:
            buffers.on_ready = self._on_ready

    @property
    def launched(self) -> frozenset[int]:
        """Buckets whose reduction has started this step (tests check they start in backward)."""
        return frozenset(self._launched)

    def arm(self) -> None:
        """The next backward is the step's last: reduce buckets as they complete."""
        self._armed = True
        self._remaining = [len(b.params) for b in self.buffers.layout.buckets]
        self._work, self._launched = [], set()

    def _on_ready(self, index: int) -> None:
        if not self._armed:
            return
        self._remaining[index] -= 1
        if self._remaining[index] == 0:
            self._launch(index)

    def _launch(self, index: int) -> None:
        bucket = self.buffers.layout.buckets[index]
        grads = self.buffers.grads[bucket.start:bucket.end]
        grads.div_(self.dp.size)
        source, out = grads, None
        if self._wire is not None:
            source = self._wire[bucket.start:bucket.end]
            source.copy_(grads)
        if not self.shard.is_whole:
            piece = self.shard.pieces[index]
            wire_out = self._wire_out if self._wire is not None else self.shard.grads
            out = wire_out[piece.local:piece.local + piece.end - piece.start]
        tag = ("bucket", index)
        work = (comm.start_all_reduce(source, self.dp, tag) if out is None
                else comm.start_reduce_scatter(out, source, self.dp, tag))
        if work is not None:
            self._work.append(work)
        self._launched.add(index)

    def finish(self) -> None:
        """Complete every bucket's reduction (call after the last backward)."""
        if self.dp.size == 1:
            self._armed = False
            if not self.shard.is_whole:  # a size-1 ZeRO-1 group: its slice is everything
                self.shard.grads.copy_(self.buffers.grads)
            return
        for index in range(len(self.buffers.layout.buckets)):
            if index not in self._launched:
                self._launch(index)
        for work in self._work:
            work.wait()
        if self._wire is not None:
            (self.buffers.grads if self.shard.is_whole else self.shard.grads).copy_(
                self._wire_out)
        self._armed = False
        self._work = []
