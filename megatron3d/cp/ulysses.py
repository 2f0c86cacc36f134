"""The all-to-all exchange (``--cp-comm-type a2a``, DeepSpeed's Ulysses): trade a shard of
the sequence for a share of the heads, attend over the whole sequence, trade back.

Each rank starts with all of its TP rank's heads for s/C tokens; one all-to-all gives it
n/C query heads (and G/C key/value heads) for all s tokens, in rank-major order (rank 0's
tokens, then rank 1's: the layout's chunk order, not the sequence's). Attention then needs
no further exchange; a second all-to-all returns each token's heads to the rank holding the
token. Traffic per rank is constant in C, unlike the ring's; the price is that C must divide
the heads and query groups of each TP rank (refused by validation otherwise).
"""

from __future__ import annotations

import torch

from megatron3d.cp.block import causal_attention
from megatron3d.cp.masks import additive_mask, gather_info, take
from megatron3d.cp.tokens import TokenInfo
from megatron3d.mpu import comm
from megatron3d.mpu.state import AxisGroup


def _to_heads(x: torch.Tensor, cp: AxisGroup) -> torch.Tensor:
    """[b, H, s/C, d] -> [b, H/C, s, d]: member i receives heads i*H/C.. of every rank."""
    b, heads, s, d = x.shape
    parts = x.reshape(b, cp.size, heads // cp.size, s, d).movedim(1, 0)
    got = comm.all_to_all(parts, cp)  # [source rank, b, H/C, s/C, d]
    return got.movedim(0, 2).reshape(b, heads // cp.size, cp.size * s, d)


def _to_sequence(x: torch.Tensor, cp: AxisGroup) -> torch.Tensor:
    """[b, H/C, s, d] -> [b, H, s/C, d]: the inverse of ``_to_heads``."""
    b, heads, s, d = x.shape
    parts = x.reshape(b, heads, cp.size, s // cp.size, d).movedim(2, 0)
    got = comm.all_to_all(parts, cp)  # [head share, b, H/C, s/C, d]
    return got.movedim(0, 1).reshape(b, cp.size * heads, s // cp.size, d)


class _ToHeads(torch.autograd.Function):
    """Sequence-sharded to head-sharded; backward is the inverse all-to-all."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cp: AxisGroup) -> torch.Tensor:
        ctx.cp = cp
        return _to_heads(x, cp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _to_sequence(grad, ctx.cp), None


class _ToSequence(torch.autograd.Function):
    """Head-sharded back to sequence-sharded; backward is ``_to_heads``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cp: AxisGroup) -> torch.Tensor:
        ctx.cp = cp
        return _to_sequence(x, cp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _to_heads(grad, ctx.cp), None


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, info: TokenInfo,
                      cp: AxisGroup, slopes: torch.Tensor | None,
                      dropout_p: float) -> torch.Tensor:
    """q [b, n, s/C, d], k and v [b, G, s/C, d], ``slopes`` [n] -> [b, n, s/C, d]."""
    tokens = gather_info(info, cp)
    # Rank-major order to sequence order: the kernel's causal mask then applies (and skips
    # the hidden half of the scores); documents and ALiBi add their mask on top.
    order = tokens.index.argsort()
    q, k, v = (_ToHeads.apply(t, cp).index_select(2, order) for t in (q, k, v))
    bias = None
    if not tokens.plain_causal or slopes is not None:
        heads = None if slopes is None else slopes.view(cp.size, -1)[cp.rank]
        in_order = take(tokens, order)
        bias = additive_mask(in_order, in_order, q.shape[0], heads, q.dtype)
    out = causal_attention(q, k, v, bias, dropout_p).index_select(2, order.argsort())
    return _ToSequence.apply(out, cp)
