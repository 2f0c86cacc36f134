"""Flat buffers and the whole-model shard over some parameters, as ZeRO-0 builds them."""

from __future__ import annotations

from torch import nn

from megatron3d.zero.buffers import FlatBuffers
from megatron3d.zero.layout import FlatLayout
from megatron3d.zero.shard import Shard


def whole(params: list[nn.Parameter]) -> tuple[FlatBuffers, Shard]:
    layout = FlatLayout.bucketed(params, lambda p: True, None, 1)
    buffers = FlatBuffers(layout, params[0].dtype, params[0].device)
    return buffers, Shard.whole(layout, buffers.params, buffers.grads)
