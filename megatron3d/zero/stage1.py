"""ZeRO-1: fp32 master weights and Adam moments partitioned across data-parallel ranks.

Each rank owns the r-th slice of every gradient bucket (``Shard.zero1``): gradients arrive
there by reduce-scatter (``GradReducer``), the optimizer updates only that slice, and
``ParamGatherer`` all-gathers the updated slices so every rank has the whole model again.
Optimizer state per rank: (4 bytes master + 8 bytes moments) x parameters / DP, plus padding.
"""

from __future__ import annotations

import torch

from megatron3d.mpu import comm
from megatron3d.mpu.state import AxisGroup
from megatron3d.optim.flat_buffers import FlatBuffers
from megatron3d.optim.shard import Shard


def zero1_shard(buffers: FlatBuffers, dp: AxisGroup) -> Shard:
    return Shard.zero1(buffers, dp.rank, dp.size)


class ParamGatherer:
    """Every rank's updated slice of every bucket into every rank's parameter buffer.

    The collective must not read from the buffer it writes, so each slice goes through one
    staging buffer allocated once (the largest slice)."""

    def __init__(self, shard: Shard, dp: AxisGroup) -> None:
        self.shard, self.dp = shard, dp
        largest = max((p.end - p.start for p in shard.pieces), default=0)
        params = shard.buffers.params
        self.staging = torch.empty(largest, dtype=params.dtype, device=params.device)

    def __call__(self) -> None:
        params = self.shard.buffers.params
        for bucket, piece in zip(self.shard.buffers.buckets, self.shard.pieces, strict=True):
            mine = self.staging[: piece.end - piece.start]
            mine.copy_(params[piece.start:piece.end])
            comm.all_gather_into(params[bucket.start:bucket.end], mine, self.dp)
