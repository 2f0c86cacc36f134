"""Causal self-attention with heads split across tensor-parallel ranks.

The fused QKV weight is laid out group by group along the output dimension: [G, n/G + 2, d]
for G key/value heads (query groups) of n query heads, i.e. each group's n/G query heads,
then its key head, then its value head (Megatron's layout). A column-parallel split then gives
each TP rank whole groups. Without grouped-query attention G = n and the layout is
[n, 3, d]: head by head, each with its own q, k, v.

Under selective recompute (``--recompute-granularity selective``) the attention core, from
q, k, v to the attention output, keeps only q, k and v for backward and is re-run there, with
the same dropout mask: on kernels that materialise them, the [b, n, s, s] scores,
probabilities and dropout mask are what grows with s^2.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from megatron3d.cp.attention import context_attention
from megatron3d.cp.layout import rank_index
from megatron3d.cp.tokens import TokenInfo
from megatron3d.model.compiled import eager
from megatron3d.model.context import LayerContext
from megatron3d.model.grouped_attention import attention
from megatron3d.model.positional import apply_rotary, rotary_tables
from megatron3d.mpu.layers import ColumnParallelLinear, RowParallelLinear

_checkpoint = eager(checkpoint)  # around a switch of dropout stream, which stays eager


@eager
def _context_attention(*args: object) -> torch.Tensor:
    """``context_attention``, eager under --compile: its exchanges are collectives."""
    return context_attention(*args)


class SelfAttention(nn.Module):
    def __init__(self, ctx: LayerContext, name: str) -> None:
        super().__init__()
        cfg, tp = ctx.cfg, ctx.tp
        h = cfg.hidden_size
        self.head_dim = cfg.head_dim
        self.local_heads = cfg.num_attention_heads // tp.size
        self.local_groups = cfg.query_groups // tp.size
        self.group_size = cfg.num_attention_heads // cfg.query_groups  # query heads per group
        self.dropout_p = cfg.attention_dropout
        qkv_size = (cfg.num_attention_heads + 2 * cfg.query_groups) * self.head_dim
        self.qkv = ColumnParallelLinear(h, qkv_size, name=f"{name}.qkv", init_std=ctx.init_std,
                                        bias=cfg.qkv_bias, **ctx.linear_kwargs())
        self.dense = RowParallelLinear(h, h, name=f"{name}.dense",
                                       init_std=ctx.output_init_std, bias=cfg.add_bias,
                                       **ctx.linear_kwargs())
        self.position_type = cfg.position_embedding_type
        self.ctx = ctx
        if self.position_type == "rope":
            cos, sin = rotary_tables(cfg, ctx.device)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.alibi = ctx.alibi if self.position_type == "alibi" else None
        self.selective = cfg.recompute == "selective"
        # Whether q stays a view of the fused output: not when rotated, nor when a rank's
        # groups interleave their query heads with keys and values (the reshape copies).
        # Then k and v get storage of their own too, and the output is freed after forward.
        self.qkv_views = self.position_type != "rope" and (self.group_size == 1
                                                           or self.local_groups == 1)

    def forward(self, x: torch.Tensor, info: TokenInfo | None = None) -> torch.Tensor:
        """``info``: where the tokens sit (``cp/tokens.py``); None for a whole sequence in
        order. Under context parallelism a stage that reads no data derives its own."""
        qkv = self.qkv(x)  # [s, b, (n + 2G) d / tp] (gathered along s under SP)
        s, b, _ = qkv.shape
        cp = self.ctx.cp
        if info is None and cp.size > 1:
            info = TokenInfo(index=rank_index(s * cp.size, cp.size, cp.rank, qkv.device))
        qkv = qkv.view(s, b, self.local_groups, self.group_size + 2, self.head_dim)
        # One split, not three indexings: its backward writes the three gradients into one
        # new tensor, where slicing and selecting would each add a zero-filled qkv-sized one.
        q, k, v = qkv.split([self.group_size, 1, 1], dim=3)
        q = q.reshape(s, b, self.local_heads, self.head_dim)
        k, v = k.squeeze(3), v.squeeze(3)  # each [s, b, G/tp, d]
        if self.position_type == "rope":
            cos, sin = self._rotary(info, b)
            q = apply_rotary(q, cos, sin)
            k = apply_rotary(k, cos, sin)
        if not self.qkv_views:  # a k or v view kept for backward would keep all of qkv
            k, v = k.contiguous(), v.contiguous()
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads or G/tp, s, d]
        if self.selective and torch.is_grad_enabled():
            out = self._recomputed_core(q, k, v, info)
        else:
            out = self._core(q, k, v, info)
        out = out.permute(2, 0, 1, 3).reshape(s, b, self.local_heads * self.head_dim)
        return self.dense(out)  # [s, b, h]

    def _rotary(self, info: TokenInfo | None,
                batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin at the tokens' positions: the tables' first rows for a whole sequence
        in order, else [s, b, 1, d] rows picked by position."""
        if info is None:
            return self.rope_cos, self.rope_sin
        rows = info.positions(batch).t()  # [s, b]
        return tuple(t.view(t.shape[0], t.shape[-1])[rows].unsqueeze(2)
                     for t in (self.rope_cos, self.rope_sin))

    def _recomputed_core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         info: TokenInfo | None) -> torch.Tensor:
        """``_core`` under selective recompute. Compiled with the layer, the compiler
        recomputes it in the layer's backward; with a switch of dropout stream inside, torch's
        checkpoint runs eagerly and replays the TP stream (``recompute_contexts``)."""
        if self.ctx.cfg.compile and not self.ctx.switches_stream(self._draws()):
            return checkpoint(self._core, q, k, v, info, use_reentrant=False)
        return _checkpoint(self._core, q, k, v, info, use_reentrant=False,
                           context_fn=self.ctx.recompute_contexts)

    def _draws(self) -> bool:
        return self.training and self.dropout_p > 0

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              info: TokenInfo | None) -> torch.Tensor:
        """softmax(q k^T / sqrt(d) + causal mask or ALiBi) v, with attention dropout: q
        [b, heads, s, d], k and v [b, G/tp, s, d] (shared by each group's query heads, not
        copied) -> [b, heads, s, d]. What selective recompute re-runs. Given ``info`` (a
        split sequence, packed documents) the mask and bias come from it (``cp/``)."""
        dropout = self.dropout_p if self._draws() else 0.0
        # each TP rank drops out its own heads
        return self.ctx.on_tp_stream(self._attend, q, k, v, info, dropout, draws=dropout > 0)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                info: TokenInfo | None, dropout: float) -> torch.Tensor:
        cp = self.ctx.cp
        if info is None or (cp.size == 1 and info.doc_ids is None):
            # the whole sequence, one attention span (positions restarting at documents only
            # move RoPE and learned positions): the kernel's own causal mask
            bias = (None if self.alibi is None
                    else self.alibi.get(q.shape[2], q.dtype, q.device))
            return attention(q, k, v, bias, dropout)
        slopes = None
        if self.alibi is not None:  # the distance in the sequence, whatever the positions
            slopes = self.alibi.slopes.to(q.device)
            info = TokenInfo(info.index, doc_ids=info.doc_ids)
        return _context_attention(q, k, v, info, cp, slopes, dropout, self.ctx.cp_comm_type)
