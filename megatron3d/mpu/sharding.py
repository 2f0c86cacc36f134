"""How a logical tensor is laid out across tensor-parallel ranks, and how to undo it.

``tp_shard`` is the one definition of the layout (initialisation uses it); ``tp_unshard`` is
its inverse, and ``gather_logical`` assembles a parameter's full logical value from every TP
rank (equivalence tests, checkpoints, exports): padding rows of vocabulary tables are dropped,
since their number depends on the layout.
"""

from __future__ import annotations

import torch

from megatron3d.errors import ConfigError
from megatron3d.mpu import comm
from megatron3d.mpu.meta import get_meta
from megatron3d.mpu.state import AxisGroup


def tp_shard(full: torch.Tensor, dim: int, rank: int, size: int, stride: int = 1) -> torch.Tensor:
    """Rank ``rank``'s slice of ``full`` along ``dim``, ``stride`` sub-matrices split separately.

    With stride 2 a [gate; up] weight gives rank r the rows [gate_r; up_r]. Checkpoint
    resharding uses the same function, so the layout is defined once.
    """
    if full.shape[dim] % (size * stride) != 0:
        raise ConfigError(f"dimension {dim} of size {full.shape[dim]} does not divide by "
                          f"tp size x stride = {size} x {stride}; choose sizes divisible by "
                          f"{size * stride}")
    subs = full.chunk(stride, dim=dim)
    return torch.cat([s.chunk(size, dim=dim)[rank] for s in subs], dim=dim).contiguous()


def tp_unshard(shards: list[torch.Tensor], dim: int, stride: int = 1) -> torch.Tensor:
    """Inverse of ``tp_shard``: the full tensor from every rank's slice, in rank order."""
    per_rank = [s.chunk(stride, dim=dim) for s in shards]  # [rank][sub]
    return torch.cat([torch.cat([r[sub] for r in per_rank], dim=dim)
                      for sub in range(stride)], dim=dim)


def gather_logical(param: torch.Tensor, tp: AxisGroup) -> torch.Tensor:
    """The full logical value of ``param`` (a collective over ``tp`` for split parameters)."""
    meta = get_meta(param)
    full = param.detach()
    if meta.tp_split_dim is not None and tp.size > 1:
        gathered = comm.all_gather(full.contiguous(), tp, dim=meta.tp_split_dim)
        full = tp_unshard(list(gathered.chunk(tp.size, dim=meta.tp_split_dim)),
                          meta.tp_split_dim, meta.tp_stride)
    if meta.logical_rows is not None:
        full = full[: meta.logical_rows]
    return full
