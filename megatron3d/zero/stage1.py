"""ZeRO-1: fp32 master weights and Adam moments partitioned across data-parallel ranks.

Each rank owns the r-th slice of every gradient bucket (``Shard.zero1``): gradients arrive
there by reduce-scatter (``GradReducer``), the optimizer updates only that slice, and
``gather_params`` all-gathers the updated slices so every rank has the whole model again.
Optimizer state per rank: (4 bytes master + 8 bytes moments) x parameters / DP, plus padding.
"""

from __future__ import annotations

from megatron3d.mpu import comm
from megatron3d.mpu.state import AxisGroup
from megatron3d.optim.flat_buffers import FlatBuffers
from megatron3d.optim.shard import Shard


def zero1_shard(buffers: FlatBuffers, dp: AxisGroup) -> Shard:
    return Shard.zero1(buffers, dp.rank, dp.size)


def gather_params(shard: Shard, dp: AxisGroup) -> None:
    """Every rank's updated slice of every bucket into every rank's parameter buffer."""
    params = shard.buffers.params
    for bucket, piece in zip(shard.buffers.buckets, shard.pieces, strict=True):
        mine = params[piece.start:piece.end].clone()  # the collective must not alias its output
        comm.all_gather_into(params[bucket.start:bucket.end], mine, dp)
