"""One pre-LN transformer block: x + drop(attn(norm(x))), then x + drop(mlp(norm(x)))."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.utils.checkpoint import checkpoint

from megatron3d.model.attention import SelfAttention
from megatron3d.model.context import LayerContext
from megatron3d.model.mlp import MLP
from megatron3d.model.norm import Norm
from megatron3d.mpu.random import RNGStreams


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
        self.rng = ctx.rng
        self.dropout_rng = ctx.sequence_shard_rng

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute and torch.is_grad_enabled():
            return checkpoint(self._block, x, use_reentrant=False,
                              context_fn=self._recompute_contexts)
        return self._block(x)

    def _recompute_contexts(self) -> tuple:
        """torch's checkpoint replays the default RNG; this replays the TP dropout stream."""
        if self.rng is None:
            return contextlib.nullcontext(), contextlib.nullcontext()
        return contextlib.nullcontext(), _replay(self.rng, self.rng.stream_states())

    def _block(self, x: torch.Tensor) -> torch.Tensor:
        p = self.hidden_dropout if self.training else 0.0
        attn = self.attention(self.input_norm(x))  # [s, b, h] or [s/tp, b, h] under SP
        with self.dropout_rng():
            x = x + F.dropout(attn, p, self.training)
        mlp = self.mlp(self.post_attention_norm(x))
        with self.dropout_rng():
            return x + F.dropout(mlp, p, self.training)


@contextlib.contextmanager
def _replay(rng: RNGStreams, states: dict[str, torch.Tensor]) -> Iterator[None]:
    """Run the recompute from the streams' forward-time states, then restore where they are."""
    current = rng.stream_states()
    rng.set_stream_states(states)
    try:
        yield
    finally:
        rng.set_stream_states(current)
