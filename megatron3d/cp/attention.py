"""Attention over a sequence split across context-parallel ranks.

``context_attention`` is the one entry point the model calls. Every exchange computes the
same function: query i sees key j when index_j <= index_i (and, given documents, they are in
the same one), with ALiBi's bias slope * (position_j - position_i) where given (``masks.py``).

The exchanges (``--cp-comm-type``):
- ``all_gather`` (here, the reference): every rank gathers the keys and values of the whole
  sequence and attends its own queries to them;
- ``p2p`` (``ring.py``): keys and values pass around the ring, one shard in memory at a
  time, the exchange overlapped with the block in hand;
- ``a2a`` (``ulysses.py``): all-to-all from sequence shards to head shards and back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812

from megatron3d.cp.masks import alibi_bias, gather_info, visible
from megatron3d.cp.ring import ring_attention
from megatron3d.cp.tokens import TokenInfo
from megatron3d.cp.ulysses import ulysses_attention
from megatron3d.mpu import comm
from megatron3d.mpu.state import AxisGroup

COMM_TYPES = ("p2p", "all_gather", "a2a")


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


def gathered_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, info: TokenInfo,
                       cp: AxisGroup, slopes: torch.Tensor | None,
                       dropout_p: float) -> torch.Tensor:
    """The all-gather exchange (and the whole computation when C = 1)."""
    keys = gather_info(info, cp) if cp.size > 1 else info
    k, v = (_GatherSequence.apply(t, cp) if cp.size > 1 else t for t in (k, v))
    mask = visible(info, keys)
    bias = mask if slopes is None else alibi_bias(slopes, info, keys, q.shape[0], mask, q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout_p,
                                          enable_gqa=k.shape[1] != q.shape[1])


def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, info: TokenInfo,
                      cp: AxisGroup, slopes: torch.Tensor | None = None,
                      dropout_p: float = 0.0, comm_type: str = "p2p") -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + mask or ALiBi) v for this rank's queries against the whole
    sequence: q [b, n, s_local, d], k and v [b, G, s_local, d] (G divides n), ``info`` this
    rank's tokens, ``slopes`` [n] this rank's heads' ALiBi slopes -> [b, n, s_local, d].
    With C = 1 there is nothing to exchange and every ``comm_type`` runs the same code."""
    if cp.size == 1 or comm_type == "all_gather":
        return gathered_attention(q, k, v, info, cp, slopes, dropout_p)
    if comm_type == "p2p":
        if dropout_p > 0:
            raise ValueError("the p2p ring has no attention dropout (refused by validation)")
        return ring_attention(q, k, v, info, cp, slopes)
    if comm_type == "a2a":
        return ulysses_attention(q, k, v, info, cp, slopes, dropout_p)
    raise ValueError(f"unknown cp comm type {comm_type!r}; one of {COMM_TYPES}")
