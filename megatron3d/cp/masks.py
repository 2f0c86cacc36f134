"""Which keys a query sees and ALiBi's bias, from the tokens' ``TokenInfo``: the one rule
every exchange applies (query i sees key j when index_j <= index_i and, given documents,
both are in the same one; ALiBi adds slope * (position_j - position_i))."""

from __future__ import annotations

import torch

from megatron3d.cp.tokens import TokenInfo
from megatron3d.mpu import comm
from megatron3d.mpu.state import AxisGroup


def visible(q: TokenInfo, k: TokenInfo) -> torch.Tensor:
    """Bool [b or 1, 1, s_q, s_k]: True where query i may attend to key j."""
    mask = (k.index.unsqueeze(0) <= q.index.unsqueeze(1)).view(1, 1, len(q.index), len(k.index))
    if q.doc_ids is not None:
        same = q.doc_ids.unsqueeze(2) == k.doc_ids.unsqueeze(1)  # [b, s_q, s_k]
        mask = mask & same.unsqueeze(1)
    return mask


def alibi_bias(slopes: torch.Tensor, q: TokenInfo, k: TokenInfo, batch: int,
               mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Float [b, n, s_q, s_k]: slope * (key position - query position), -inf where hidden;
    computed in fp32, cast once."""
    distance = (k.positions(batch).unsqueeze(1) - q.positions(batch).unsqueeze(2)).float()
    bias = slopes.float().view(1, -1, 1, 1) * distance.unsqueeze(1)
    return bias.masked_fill(~mask, float("-inf")).to(dtype)


def additive_mask(q: TokenInfo, k: TokenInfo, batch: int, slopes: torch.Tensor | None,
                  dtype: torch.dtype) -> torch.Tensor:
    """Float [b or 1, n or 1, s_q, s_k]: 0 (or ALiBi's bias) where visible, -inf elsewhere
    (what fused kernels take)."""
    mask = visible(q, k)
    if slopes is not None:
        return alibi_bias(slopes, q, k, batch, mask, dtype)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
        ~mask, float("-inf"))


def gather_info(info: TokenInfo, cp: AxisGroup) -> TokenInfo:
    """The whole sequence's TokenInfo, in the gathered (rank-major) order."""
    def cat(t: torch.Tensor | None, dim: int) -> torch.Tensor | None:
        return None if t is None else comm.all_gather(t.contiguous(), cp, dim=dim)
    return TokenInfo(index=cat(info.index, 0), position_ids=cat(info.position_ids, 1),
                     doc_ids=cat(info.doc_ids, 1))


def take(info: TokenInfo, part: slice | torch.Tensor) -> TokenInfo:
    """The tokens ``part`` (a slice, or the places in a new order) of ``info``."""
    def cut(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[:, part]
    return TokenInfo(index=info.index[part], position_ids=cut(info.position_ids),
                     doc_ids=cut(info.doc_ids))
