"""ZeRO-1's parameter all-gather after the optimizer step.

Each rank updated the r-th slice of every bucket; one all-gather per bucket brings every
rank's slice into every rank's flat parameter buffer. The slice is read in place (it already
sits at its offset in the output, which NCCL and gloo accept), so there is no staging copy.

With ``overlap`` (``--overlap-param-gather``) the gathers are only started after the step; a
forward pre-hook on each layer waits for the buckets whose parameters that layer is the first
to use, so the next forward computes early layers while later buckets are still in flight.
``flush()`` waits for everything (before anything reads all parameters outside a forward).
"""

from __future__ import annotations

from torch import nn

from megatron3d.mpu import comm
from megatron3d.mpu.state import AxisGroup
from megatron3d.zero.buffers import FlatBuffers
from megatron3d.zero.shard import Shard


class ParamGatherer:
    def __init__(self, buffers: FlatBuffers, shard: Shard, dp: AxisGroup, overlap: bool,
                 layers: list[nn.Module]) -> None:
        self.buffers, self.shard, self.dp, self.overlap = buffers, shard, dp, overlap
        self.pending: dict[int, object] = {}  # bucket index -> in-flight gather
        self.first_use: dict[int, int] = {}  # bucket index -> index of its first layer
        if overlap:
            layer_of: dict[int, int] = {}  # the first layer using each parameter (tied!)
            for i, layer in enumerate(layers):
                for p in layer.parameters():
                    layer_of.setdefault(id(p), i)
            for b, bucket in enumerate(buffers.layout.buckets):
                self.first_use[b] = min(layer_of[id(p)] for p in bucket.params)
            for i, layer in enumerate(layers):
                waits = [b for b, first in self.first_use.items() if first == i]
                layer.register_forward_pre_hook(lambda _m, _x, waits=waits: self._wait(waits))

    def __call__(self) -> None:
        self.flush()
        params = self.buffers.params
        for b, (bucket, piece) in enumerate(zip(self.buffers.layout.buckets, self.shard.pieces,
                                                strict=True)):
            out, mine = params[bucket.start:bucket.end], params[piece.start:piece.end]
            if self.overlap:
                work = comm.start_all_gather_into(out, mine, self.dp, ("bucket", b))
                if work is not None:
                    self.pending[b] = work
            else:
                comm.all_gather_into(out, mine, self.dp, ("bucket", b))

    def _wait(self, buckets: list[int]) -> None:
        for b in buckets:
            work = self.pending.pop(b, None)
            if work is not None:
                work.wait()

    def flush(self) -> None:
        self._wait(list(self.pending))
