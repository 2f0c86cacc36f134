"""One pre-LN transformer block: x + drop(attn(norm(x))), then x + drop(mlp(norm(x)))."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from megatron3d.cp.tokens import TokenInfo
from megatron3d.model.attention import SelfAttention
from megatron3d.model.compiled import compiled
from megatron3d.model.context import LayerContext
from megatron3d.model.mlp import MLP
from megatron3d.model.norm import Norm


class TransformerLayer(nn.Module):
    """A pipeline layer; under full recompute (``--recompute-granularity full`` or
    ``--checkpoint-activations``) it keeps only its input and is re-run in backward. Under
    --compile its computation (``_block``) is compiled, the module and its hooks stay eager
    (``model/compiled.py``)."""

    def __init__(self, ctx: LayerContext, layer_number: int) -> None:
        super().__init__()
        name = f"layers.{layer_number}"
        self.input_norm = Norm(ctx, f"{name}.input_norm")
        self.attention = SelfAttention(ctx, f"{name}.attention")
        self.post_attention_norm = Norm(ctx, f"{name}.post_attention_norm")
        self.mlp = MLP(ctx, f"{name}.mlp")
        self.recompute = ctx.cfg.recompute == "full"
        self.ctx = ctx
        self.rng = ctx.rng  # the dropout streams this layer draws from
        self._run = compiled(self._block) if ctx.cfg.compile else self._block

    takes_token_info = True  # attention reads where the tokens sit (Stage.forward)

    def forward(self, x: torch.Tensor, info: TokenInfo | None = None) -> torch.Tensor:
        if self.recompute and torch.is_grad_enabled():  # info passed in: the re-run sees it
            return checkpoint(self._run, x, info, use_reentrant=False,
                              context_fn=self._recompute_contexts)
        return self._run(x, info)

    def _recompute_contexts(self) -> tuple:
        """torch's checkpoint replays the default RNG; this replays the TP dropout stream."""
        return self.ctx.recompute_contexts()

    def _block(self, x: torch.Tensor, info: TokenInfo | None) -> torch.Tensor:
        attn = self.attention(self.input_norm(x), info)  # [s, b, h] or [s/tp, b, h] under SP
        x = x + self.ctx.hidden_dropout(attn, self.training)
        mlp = self.mlp(self.post_attention_norm(x))
        return x + self.ctx.hidden_dropout(mlp, self.training)
