"""Every gradient reduction between backward and the optimizer step, in one place.

Order: data-parallel reductions (ZeRO-0/1 buckets started during each model chunk's last
backward and completed here; ZeRO-3's reduce-scatters are already done), then the sums over
tensor-parallel ranks of sequence-parallel replicated parameters, then the sum of tied
embedding copies over the embedding group. All are sums, so the order does not change the
result; each runs on the gradients this rank's optimizer reads (its ZeRO shard, or all).
"""

from __future__ import annotations

from torch import nn

from megatron3d.mpu import comm
from megatron3d.mpu.meta import get_meta
from megatron3d.mpu.state import ParallelState
from megatron3d.pipeline.tied import TiedWeights
from megatron3d.zero.factory import DataParallel


class GradSync:
    def __init__(self, params: list[nn.Parameter], data_parallel: DataParallel,
                 tied: TiedWeights, state: ParallelState) -> None:
        self.data_parallel = data_parallel
        self.state = state
        shard = data_parallel.shard
        self._sequence_parallel = shard.grads_of(
            [p for p in params if get_meta(p).sequence_parallel])
        self._tied = shard.grads_of(tied.params)

    def before_last_backward(self, chunk: int) -> None:
        """Model chunk ``chunk``'s last backward of the step runs next (the engine's call)."""
        self.data_parallel.before_last_backward(chunk)

    def __call__(self) -> None:
        self.data_parallel.finish()
        comm.all_reduce_coalesced(self._sequence_parallel, self.state.tp)
        comm.all_reduce_coalesced(self._tied, self.state.embedding)
