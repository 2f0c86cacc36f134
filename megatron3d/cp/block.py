"""Attention of a block of queries against a block of keys, with its logsumexp, and the
online-softmax merge of such partial results: what the ring (``ring.py``) is built from.

A block's result is (out, lse): the block's softmax-weighted values and, per query row, the
log of its softmax denominator (-inf for a row that sees no key of the block). Two blocks over
disjoint keys merge exactly: lse = logaddexp(lse1, lse2), out = out1 e^(lse1-lse) + out2
e^(lse2-lse). Backward needs no per-block state: given the final out and lse, a block's
probabilities are exp(scores - lse) (the flash-attention recurrence run backwards).

Shapes: q [b, n, sq, d]; k, v [b, G, sk, d] with G dividing n (each key/value head serves
n/G query heads, never copied); ``bias`` None or an additive float mask in q's dtype, -inf
where hidden, broadcasting to [b, n, sq, sk]; ``causal``: the block is square and on the
diagonal (query i sees at most keys 0..i, whatever the bias allows).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812

# The CPU's fused flash kernel returns the logsumexp a merge needs and recomputes a block's
# probabilities in backward from it; SDPA's public API returns neither (nor takes a mask and
# causal skipping at once). It is a private op: used only here, behind ``forward``,
# ``backward`` and ``causal_attention``, each with a fallback wherever it is missing (other
# devices, other torch versions): matmuls, or SDPA.
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_CPU_BACKWARD = getattr(torch.ops.aten,
                              "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def _use_fused(q: torch.Tensor, fused: bool | None) -> bool:
    available = q.device.type == "cpu" and _FLASH_CPU is not None
    return available if fused is None else fused and available


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
            causal: bool, fused: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """out [b, n, sq, d] in q's dtype, lse [b, n, sq] fp32. ``fused``: None picks the fused
    kernel where there is one (tests force either)."""
    if _use_fused(q, fused):
        out, lse = _FLASH_CPU(q, k, v, 0.0, causal, attn_mask=bias)
        if bias is not None:  # the kernel reports 0, not -inf, for a row that sees nothing
            lse = lse.masked_fill(_unseen_rows(bias), float("-inf"))
        return out, lse
    scores = _scores(q, k, bias, causal)
    lse = torch.logsumexp(scores, dim=-1)
    out = _grouped(_probabilities(scores, lse), v.float()).to(q.dtype)
    return out, lse


def backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             out: torch.Tensor, lse: torch.Tensor, bias: torch.Tensor | None, causal: bool,
             fused: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq [b, n, sq, d], dk and dv [b, G, sk, d] of this block, given the gradient of the
    FINAL output, the final output and the final lse of these query rows."""
    if _use_fused(q, fused):
        return _FLASH_CPU_BACKWARD(grad.contiguous(), q, k, v, out.contiguous(),
                                   lse.contiguous(), 0.0, causal, attn_mask=bias)
    b, n, sq, d = q.shape
    groups, sk = k.shape[1], k.shape[2]
    p = _probabilities(_scores(q, k, bias, causal), lse)  # [b, n, sq, sk]
    g = grad.float()
    dv = p.reshape(b, groups, -1, sk).transpose(2, 3) @ g.reshape(b, groups, -1, d)
    dp = _grouped(g, v.float().transpose(2, 3))  # [b, n, sq, sk]
    rows = (g * out.float()).sum(-1, keepdim=True)  # [b, n, sq, 1]
    ds = p * (dp - rows) * d ** -0.5
    dq = _grouped(ds, k.float())
    dk = ds.reshape(b, groups, -1, sk).transpose(2, 3) @ q.float().reshape(b, groups, -1, d)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     bias: torch.Tensor | None, dropout_p: float) -> torch.Tensor:
    """softmax attention of tokens in sequence order, causal and, given one, under ``bias``
    (which must itself hide every key after its query), through autograd -> [b, n, s, d].
    The fused CPU kernel takes both at once and so skips the hidden upper half; SDPA takes
    one or the other (and has the dropout)."""
    if dropout_p == 0 and bias is not None and _use_fused(q, None):
        return _FLASH_CPU(q, k, v, 0.0, True, attn_mask=bias)[0]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout_p,
                                          is_causal=bias is None,
                                          enable_gqa=k.shape[1] != q.shape[1])


def merge_(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
           block_lse: torch.Tensor) -> None:
    """Fold a block's (out, lse) over other keys into the running fp32 ``out`` [b, n, s, d]
    and ``lse`` [b, n, s], in place. ``lse`` must be finite (every query sees itself in the
    first block merged); a block's -inf rows leave them unchanged."""
    total = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - total).unsqueeze(-1))
    out.add_(block_out.float() * torch.exp(block_lse - total).unsqueeze(-1))
    lse.copy_(total)


def _unseen_rows(bias: torch.Tensor) -> torch.Tensor:
    """Bool broadcasting to [b, n, sq]: rows whose every key is hidden."""
    return torch.isneginf(bias).all(dim=-1)


def _grouped(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x [b, n, s, m] @ y [b, G, m, p] -> [b, n, s, p]: each group's query heads as one
    block of rows (no copy of y per query head)."""
    b, n, s, _ = x.shape
    groups = y.shape[1]
    return (x.reshape(b, groups, n // groups * s, -1) @ y).view(b, n, s, -1)


def _scores(q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor | None,
            causal: bool) -> torch.Tensor:
    """fp32 [b, n, sq, sk]: q k^T / sqrt(d) plus the mask."""
    scores = _grouped(q.float(), k.float().transpose(2, 3)) * q.shape[-1] ** -0.5
    if bias is not None:
        scores = scores + bias.float()
    if causal:
        sq, sk = scores.shape[-2:]
        above = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(above, float("-inf"))
    return scores


def _probabilities(scores: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """exp(scores - lse), 0 in rows that see nothing (lse -inf)."""
    return torch.exp(scores - lse.masked_fill(torch.isneginf(lse), 0.0).unsqueeze(-1))
