"""Data-parallel gradient reduction in buckets, overlapped with the last backward pass.

Gradients accumulate locally over a step's micro-batches; only the last micro-batch's
backward produces final gradients. ``arm()`` is called just before that backward: from then
on, each parameter's post-accumulate hook counts down its bucket, and a bucket whose last
gradient has arrived is divided by the DP size and reduced asynchronously while backward
continues with earlier layers. ``finish()`` reduces whatever did not complete (parameters
that got no gradient) and waits for everything.

ZeRO-0 all-reduces each bucket in place. ZeRO-1 reduce-scatters it, so each rank receives
only the averaged gradients of its own slice (``Shard``), which is all its optimizer needs.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron3d.mpu import comm
from megatron3d.mpu.state import AxisGroup
from megatron3d.optim.flat_buffers import FlatBuffers
from megatron3d.optim.shard import Shard


class GradReducer:
    def __init__(self, buffers: FlatBuffers, shard: Shard, dp: AxisGroup) -> None:
        self.buffers, self.shard, self.dp = buffers, shard, dp
        self._bucket_of: dict[int, int] = {}
        for index, bucket in enumerate(buffers.buckets):
            for p in bucket.params:
                self._bucket_of[id(p)] = index
                if dp.size > 1:
                    p.register_post_accumulate_grad_hook(self._on_grad)
        self._armed = False
        self._remaining: list[int] = []
        self._work: list = []
        self._launched: set[int] = set()

    @property
    def launched(self) -> frozenset[int]:
        """Buckets whose reduction has started this step (tests check they start in backward)."""
        return frozenset(self._launched)

    def arm(self) -> None:
        """The next backward is the step's last: reduce buckets as they complete."""
        self._armed = True
        self._remaining = [len(b.params) for b in self.buffers.buckets]
        self._work, self._launched = [], set()

    def _on_grad(self, param: nn.Parameter) -> None:
        if not self._armed:
            return
        index = self._bucket_of[id(param)]
        self._remaining[index] -= 1
        if self._remaining[index] == 0:
            self._launch(index)

    def _launch(self, index: int) -> None:
        bucket = self.buffers.buckets[index]
        grads = self.buffers.grads[bucket.start:bucket.end]
        grads.div_(self.dp.size)
        if self.shard.is_whole:
            work = comm.start_all_reduce(grads, self.dp)
        else:
            piece = self.shard.pieces[index]
            out = self.shard.grads[piece.local:piece.local + piece.end - piece.start]
            work = comm.start_reduce_scatter(out, grads, self.dp)
        if work is not None:
            self._work.append(work)
        self._launched.add(index)

    def finish(self) -> None:
        """Complete every bucket's reduction (call after the last backward)."""
        if self.dp.size == 1 and self.shard.is_whole:
            self._armed = False
            return
        for index in range(len(self.buffers.buckets)):
            if index not in self._launched:
                self._launch(index)
        for work in self._work:
            work.wait()
        self._armed = False
        self._work = []


def average_over(loss: torch.Tensor, dp: AxisGroup) -> torch.Tensor:
    """The mean of ``loss`` over data-parallel ranks (for logging the global batch's loss)."""
    if dp.size == 1:
        return loss
    return comm.all_reduce(loss.clone(), dp) / dp.size
