"""ZeRO-0 and ZeRO-1: every rank holds all parameters in one flat buffer.

ZeRO-0 all-reduces gradient buckets and every rank updates everything. ZeRO-1 reduce-scatters
them: each rank updates its 1/DP slice of every bucket (fp32 master and Adam state only for
that slice) and the updated slices are all-gathered back (``gather.py``). Optimizer state per
rank under ZeRO-1: (4 bytes master + 8 bytes moments) x parameters / DP, plus padding.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from megatron3d.config import ParallelConfig
from megatron3d.mpu.state import AxisGroup
from megatron3d.zero.buffers import FlatBuffers
from megatron3d.zero.gather import ParamGatherer
from megatron3d.zero.layout import Counted, FlatLayout, param_chunks
from megatron3d.zero.reducer import GradReducer
from megatron3d.zero.shard import Shard


class Zero01:
    observer = None  # nothing to plan: every parameter is always resident
    secondary_numel = 0

    def __init__(self, params: list[nn.Parameter], layers: list[nn.Module], dp: AxisGroup,
                 parallel: ParallelConfig, counted: Counted, wire: torch.dtype,
                 device: torch.device, chunk_sizes: tuple[int, ...]) -> None:
        """``chunk_sizes``: how many of ``layers`` (in order) each model chunk holds."""
        sliced = parallel.zero_stage == 1
        chunks = param_chunks(layers, chunk_sizes)
        layout = FlatLayout.bucketed(params, counted, parallel.reduce_bucket_size,
                                     dp.size if sliced else 1, chunks)
        self.params = params
        self.buffers = FlatBuffers(layout, params[0].dtype, device)
        if sliced:
            self.shard = Shard.sliced(layout, dp.rank, dp.size, self.buffers.params,
                                      self.buffers.params_dtype, device,
                                      zeroed=(self.buffers.grads,))
        else:
            self.shard = Shard.whole(layout, self.buffers.params, self.buffers.grads)
        self.reducer = GradReducer(self.buffers, self.shard, dp, chunks, wire)
        self.gatherer = (ParamGatherer(self.buffers, self.shard, dp,
                                       parallel.overlap_param_gather, layers)
                         if sliced else None)
        self.norm_axis = dp if sliced else None  # ZeRO-1: the slices hold the stage once
        self.replica_axis = None if sliced else dp  # ZeRO-0: every rank holds everything

    def gather_params(self) -> None:
        if self.gatherer is not None:
            self.gatherer()

    def before_last_backward(self, chunk: int) -> None:
        """Model chunk ``chunk``'s last backward of the step runs next."""
        self.reducer.arm(chunk)

    def finish(self) -> None:
        self.reducer.finish()

    def flush(self) -> None:
        """Complete parameter gathers still in flight (--overlap-param-gather)."""
        if self.gatherer is not None:
            self.gatherer.flush()

    def values_of(self, params: list[nn.Parameter]) -> list[tuple[nn.Parameter, torch.Tensor]]:
        self.flush()
        return [(p, p.detach().reshape(-1)) for p in params]

    def materialize(self, fn: Callable[[list[nn.Parameter]], None]) -> None:
        self.flush()
        fn(self.params)

    def resident_bytes(self) -> tuple[int, int]:
        shard_grads = 0 if self.shard.is_whole else self.shard.grads.nbytes
        grads = self.buffers.grads.nbytes + shard_grads
        return self.buffers.params.nbytes, grads
