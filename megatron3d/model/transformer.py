"""One pre-LN transformer block: x + drop(attn(norm(x))), then x + drop(mlp(norm(x)))."""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.utils.checkpoint import checkpoint

from megatron3d.model.attention import SelfAttention
from megatron3d.model.context import LayerContext
from megatron3d.model.mlp import MLP
from megatron3d.model.norm import Norm


class TransformerLayer(nn.Module):
    """A pipeline layer; with ``checkpoint_activations`` it is recomputed in backward."""

    def __init__(self, ctx: LayerContext, layer_number: int) -> None:
        super().__init__()
        name = f"layers.{layer_number}"
        self.input_norm = Norm(ctx, f"{name}.input_norm")
        self.attention = SelfAttention(ctx, f"{name}.attention")
        self.post_attention_norm = Norm(ctx, f"{name}.post_attention_norm")
        self.mlp = MLP(ctx, f"{name}.mlp")
        self.hidden_dropout = ctx.cfg.hidden_dropout
        self.recompute = ctx.cfg.checkpoint_activations

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute and torch.is_grad_enabled():
            return checkpoint(self._block, x, use_reentrant=False)
        return self._block(x)

    def _block(self, x: torch.Tensor) -> torch.Tensor:
        p = self.hidden_dropout if self.training else 0.0
        x = x + F.dropout(self.attention(self.input_norm(x)), p, self.training)
        return x + F.dropout(self.mlp(self.post_attention_norm(x)), p, self.training)
