"""The all-to-all exchange (``--cp-comm-type a2a``, DeepSpeed's Ulysses): trade a shard of
the sequence for a share of the heads, attend over the whole sequence, trade back.

Each rank starts with all of its TP rank's heads for s/C tokens; one all-to-all gives it
n/C query heads (and G/C key/value heads) for all s tokens, in rank-major order (rank 0's
tokens, then rank 1's: the layout's chunk order, not the sequence's). Attention then needs
no further exchange; a second all-to-all returns each token's heads to the rank holding the
token. Traffic per rank is constant in C, unlike the ring's; the price is that C must divide
the heads and query groups of each TP rank (refused by validation otherwise).

Memory: the kernel's backward needs the head-sharded output, the projection after attention
keeps the sequence-sharded one; both kept would hold the output twice. Without dropout the
output comes back laid out [s/C, b, n, d] underneath (what the projection's input reshapes
to without a copy, so the two share it), and backward trades it back to heads with one more
all-to-all instead of keeping the head-sharded copy (``_AttendAndReturn``).
"""

from __future__ import annotations

import torch

from megatron3d.cp import block
from megatron3d.cp.block import causal_attention
from megatron3d.cp.layout import rank_index
from megatron3d.cp.masks import additive_mask, gather_info, take
from megatron3d.cp.tokens import TokenInfo
from megatron3d.mpu import comm
from megatron3d.mpu.state import AxisGroup


class _AllToAll(torch.autograd.Function):
    """``comm.all_to_all`` (part i of dim 0 to member i) under autograd: it is its own
    adjoint, the gradient of the part received from member j going back to member j."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cp: AxisGroup) -> torch.Tensor:
        ctx.cp = cp
        return comm.all_to_all(x, cp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return comm.all_to_all(grad, ctx.cp), None


def _to_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              cp: AxisGroup) -> list[torch.Tensor]:
    """q [b, n, s/C, d], k and v [b, G, s/C, d] -> [b, n/C or G/C, s, d] each (member i gets
    heads i*n/C.. and groups i*G/C..), in one all-to-all: for every member its share of q,
    then of k, then of v."""
    b, _, s, d = q.shape
    shares = [t.reshape(b, cp.size, t.shape[1] // cp.size, s, d) for t in (q, k, v)]
    got = _AllToAll.apply(torch.cat(shares, dim=2).movedim(1, 0), cp)  # [from, b, H, s/C, d]
    merged = got.movedim(0, 2).reshape(b, got.shape[2], cp.size * s, d)
    return list(merged.split([t.shape[2] for t in shares], dim=1))


def _to_sequence(x: torch.Tensor, cp: AxisGroup) -> torch.Tensor:
    """[b, n/C, s, d] -> [b, n, s/C, d]: the inverse of ``_to_heads`` for one tensor."""
    b, heads, s, d = x.shape
    parts = x.reshape(b, heads, cp.size, s // cp.size, d).movedim(2, 0)
    got = _AllToAll.apply(parts, cp)  # [head share, b, n/C, s/C, d]
    return got.movedim(0, 1).reshape(b, cp.size * heads, s // cp.size, d)


def _sequence_major(x: torch.Tensor, cp: AxisGroup) -> torch.Tensor:
    """``_to_sequence`` without autograd, laid out [s/C, b, n, d] underneath (returned as
    its [b, n, s/C, d] view): the model's [s/C, b, n * d] projection input is then a view."""
    b, heads, s, d = x.shape
    got = comm.all_to_all(x.reshape(b, heads, cp.size, s // cp.size, d).movedim(2, 0), cp)
    seq_major = got.permute(3, 1, 0, 2, 4).reshape(s // cp.size, b, cp.size * heads, d)
    return seq_major.permute(1, 2, 0, 3)


def _heads_of(x: torch.Tensor, cp: AxisGroup) -> torch.Tensor:
    """[b, n, s/C, d] -> [b, n/C, s, d] in rank-major token order, without autograd."""
    b, n, s, d = x.shape
    got = comm.all_to_all(x.reshape(b, cp.size, n // cp.size, s, d).movedim(1, 0), cp)
    return got.movedim(0, 2).reshape(b, n // cp.size, cp.size * s, d)


class _AttendAndReturn(torch.autograd.Function):
    """Attention over the whole sequence in order, the output put back in rank-major order
    and traded back to sequence shards; saves q, k, v, the logsumexp and the returned
    output, whose head-sharded form backward gets back by an all-to-all."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                bias: torch.Tensor | None, order: torch.Tensor, cp: AxisGroup) -> torch.Tensor:
        out, lse = block.forward(q, k, v, bias, causal=True)
        back = order.argsort()
        returned = _sequence_major(out.index_select(2, back), cp)
        ctx.save_for_backward(q, k, v, lse, returned)
        ctx.bias, ctx.order, ctx.cp = bias, order, cp
        return returned

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        q, k, v, lse, returned = ctx.saved_tensors
        out, grad = (_heads_of(t, ctx.cp).index_select(2, ctx.order) for t in (returned, grad))
        dq, dk, dv = block.backward(grad, q, k, v, out, lse, ctx.bias, causal=True)
        return dq, dk, dv, None, None, None


def _tokens(info: TokenInfo, cp: AxisGroup) -> TokenInfo:
    """Every rank's tokens in rank-major order. Their places alone follow from the layout
    (no exchange); documents and positions are gathered."""
    if not info.plain_causal:
        return gather_info(info, cp)
    s = len(info.index) * cp.size
    return TokenInfo(index=torch.cat([rank_index(s, cp.size, r, info.index.device)
                                      for r in range(cp.size)]))


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, info: TokenInfo,
                      cp: AxisGroup, slopes: torch.Tensor | None,
                      dropout_p: float) -> torch.Tensor:
    """q [b, n, s/C, d], k and v [b, G, s/C, d], ``slopes`` [n] -> [b, n, s/C, d]."""
    tokens = _tokens(info, cp)
    # Rank-major order to sequence order: the kernel's causal mask then applies (and skips
    # the hidden half of the scores); documents and ALiBi add their mask on top.
    order = tokens.index.argsort()
    q, k, v = (t.index_select(2, order) for t in _to_heads(q, k, v, cp))
    bias = None
    if not tokens.plain_causal or slopes is not None:
        heads = None if slopes is None else slopes.view(cp.size, -1)[cp.rank]
        in_order = take(tokens, order)
        bias = additive_mask(in_order, in_order, q.shape[0], heads, q.dtype)
    if dropout_p == 0:
        return _AttendAndReturn.apply(q, k, v, bias, order, cp)
    out = causal_attention(q, k, v, bias, dropout_p).index_select(2, order.argsort())
    return _to_sequence(out, cp)
