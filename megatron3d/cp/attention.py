"""Attention over a sequence split across context-parallel ranks.

``context_attention`` is the one entry point the model calls. Every exchange computes the
same function: query i sees key j when index_j <= index_i (and, given documents, they are in
the same one), with ALiBi's bias slope * (position_j - position_i) where given.

This module holds the all-gather exchange (every rank gathers the keys and values of the
whole sequence and attends its own queries to them); the ring (p2p) and all-to-all (Ulysses)
exchanges compute the same result with less memory or traffic.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812

from megatron3d.cp.tokens import TokenInfo
from megatron3d.mpu import comm
from megatron3d.mpu.state import AxisGroup


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 2 ([b, heads, s, d]); backward sums each rank's gradient slice
    (a reduce-scatter): every rank's queries used every rank's keys."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cp: AxisGroup) -> torch.Tensor:
        ctx.cp = cp
        return comm.all_gather(x.contiguous(), cp, dim=2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return comm.reduce_scatter(grad.contiguous(), ctx.cp, dim=2), None


def visible(q: TokenInfo, k: TokenInfo, batch: int) -> torch.Tensor:
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


def gather_info(info: TokenInfo, cp: AxisGroup) -> TokenInfo:
    """The whole sequence's TokenInfo, in the gathered (rank-major) order."""
    def cat(t: torch.Tensor | None, dim: int) -> torch.Tensor | None:
        return None if t is None else comm.all_gather(t.contiguous(), cp, dim=dim)
    return TokenInfo(index=cat(info.index, 0), position_ids=cat(info.position_ids, 1),
                     doc_ids=cat(info.doc_ids, 1))


def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, info: TokenInfo,
                      cp: AxisGroup, slopes: torch.Tensor | None = None,
                      dropout_p: float = 0.0, comm_type: str = "all_gather") -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + mask or ALiBi) v for this rank's queries against the whole
    sequence: q [b, n, s_local, d], k and v [b, G, s_local, d] (G divides n), ``info`` this
    rank's tokens, ``slopes`` [n] this rank's heads' ALiBi slopes -> [b, n, s_local, d]."""
    keys = gather_info(info, cp) if cp.size > 1 else info
    k, v = (_GatherSequence.apply(t, cp) if cp.size > 1 else t for t in (k, v))
    mask = visible(info, keys, q.shape[0])
    bias = mask if slopes is None else alibi_bias(slopes, info, keys, q.shape[0], mask, q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout_p,
                                          enable_gqa=k.shape[1] != q.shape[1])
