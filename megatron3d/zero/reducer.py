"""Data-parallel gradient reduction in buckets, overlapped with the last backward passes
(ZeRO-0 and ZeRO-1).

Gradients accumulate locally over a step's micro-batches; a model chunk's gradients are final
once its last backward of the step has run (one chunk per stage, or ``v`` under
interleaving, whose last backwards end at different times). ``arm(chunk)`` is called just
before that backward: from then on, the buffers' gradient hook counts down each of the
chunk's buckets, and a bucket whose last gradient has arrived is divided by the DP size and
reduced asynchronously while backward continues with earlier layers and other chunks. A
bucket of parameters several chunks use is armed with the last of them. ``finish()`` reduces
whatever did not complete (parameters that got no gradient), waits for everything and ends
the step.

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
from megatron3d.zero.layout import Chunks
from megatron3d.zero.shard import Shard


class GradReducer:
    def __init__(self, buffers: FlatBuffers, shard: Shard, dp: AxisGroup, chunks: Chunks,
                 reduce_dtype: torch.dtype = torch.float32) -> None:
        """``chunks``: which model chunks use each parameter (``layout.param_chunks``)."""
        self.buffers, self.shard, self.dp = buffers, shard, dp
        self._chunks = _bucket_chunks(buffers, chunks)
        self._reset()
        self._wire = self._wire_out = None
        if reduce_dtype != torch.float32 and dp.size > 1:
            self._wire = torch.empty_like(buffers.grads, dtype=reduce_dtype)
            self._wire_out = (self._wire if shard.is_whole
                              else torch.empty_like(shard.grads, dtype=reduce_dtype))
        if dp.size > 1:
            buffers.on_ready = self._on_ready

    @property
    def launched(self) -> frozenset[int]:
        """Buckets whose reduction has started this step, until ``finish`` (tests check they
        start in backward)."""
        return frozenset(self._launched)

    def _reset(self) -> None:
        self._announced: set[int] = set()  # chunks whose last backward has begun
        self._remaining: list[int | None] = [None] * len(self._chunks)  # None: not armed
        self._work: list = []
        self._launched: set[int] = set()

    def arm(self, chunk: int) -> None:
        """``chunk``'s next backward is its last of the step: reduce its buckets (those all
        of whose chunks are now armed) as they complete."""
        self._announced.add(chunk)
        for index, chunks in enumerate(self._chunks):
            if self._remaining[index] is None and chunks <= self._announced:
                self._remaining[index] = len(self.buffers.layout.buckets[index].params)

    def _on_ready(self, index: int) -> None:
        left = self._remaining[index]
        if left is None:
            return
        if left == 0:
            raise RuntimeError(f"a gradient of bucket {index} arrived after its reduction "
                               "started; this is a bug")
        self._remaining[index] = left - 1
        if left == 1:
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
            self._reset()
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
        self._reset()


def _bucket_chunks(buffers: FlatBuffers, chunks: Chunks) -> list[frozenset[int]]:
    """The chunks whose layers use each bucket's parameters."""
    return [frozenset().union(*(chunks.get(id(p), frozenset()) for p in bucket.params))
            for bucket in buffers.layout.buckets]
