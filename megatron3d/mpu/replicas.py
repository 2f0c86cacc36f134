"""Copies of one logical parameter on several ranks: which copy counts, and a check that
TP-replicated parameters are still bitwise identical on every TP rank.

Replicas can only drift through a bug (a missed gradient reduction, rank-dependent
arithmetic), and a drifted model trains on silently. Rank 0 of the TP group broadcasts its
replicated parameters; every rank compares and the verdict is agreed, so all ranks fail
together with the names of the parameters that differ.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron3d.mpu import comm
from megatron3d.mpu.meta import get_meta
from megatron3d.mpu.state import AxisGroup, ParallelState


def counted_once(state: ParallelState, param: nn.Parameter) -> bool:
    """Whether this rank's copy of ``param`` is the one counted wherever each logical
    parameter must count once (the grad norm, a checkpoint's chunks): TP replicas on TP rank
    0, tied copies on the first pipeline stage. DP replicas are the caller's to decide."""
    meta = get_meta(param)
    if meta.tied_key is not None and not state.is_first_stage:
        return False
    return meta.tp_split_dim is not None or state.tp.rank == 0


class ReplicaDriftError(RuntimeError):
    """TP-replicated parameters differ across TP ranks."""


def check_tp_replicas(values: list[tuple[nn.Parameter, torch.Tensor]], tp: AxisGroup) -> None:
    """Raise ReplicaDriftError on every TP rank if any replicated parameter differs.

    ``values``: (parameter, the values of it this rank holds): the whole parameter, or under
    ZeRO-3 its shard, which covers the same elements on every TP rank."""
    if tp.size == 1:
        return
    replicated = [(p, v) for p, v in values if get_meta(p).tp_split_dim is None]
    if not replicated:
        return
    mine = torch.cat([v.detach().flatten() for _, v in replicated])
    reference = comm.broadcast(mine.clone(), tp, src_index=0)
    sizes = [v.numel() for _, v in replicated]
    differs = torch.tensor([float(not _same_bits(a, b)) for a, b in zip(
        mine.split(sizes), reference.split(sizes), strict=True)], device=mine.device)
    comm.all_reduce(differs, tp, op=comm.MAX)  # every rank learns which ones differ
    names = [get_meta(p).name for (p, _), d in zip(replicated, differs.tolist(), strict=True)
             if d]
    if names:
        raise ReplicaDriftError(f"TP-replicated parameters drifted apart across TP ranks "
                                f"{list(tp.ranks)}: {', '.join(names)}; this is a bug, please "
                                "report it")


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (a NaN equals the same NaN)."""
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
