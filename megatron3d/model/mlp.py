"""The feed-forward block: column-parallel up projection, activation, row-parallel down.

GeLU uses the tanh approximation, which is what GPT-2 and BLOOM were trained with (so exports
to their Hugging Face classes match). SwiGLU stacks gate and up projections in one weight,
split per TP rank with stride 2 so each rank holds matching gate and up rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from megatron3d.model.context import LayerContext
from megatron3d.mpu.layers import ColumnParallelLinear, RowParallelLinear


class MLP(nn.Module):
    def __init__(self, ctx: LayerContext, name: str) -> None:
        super().__init__()
        cfg = ctx.cfg
        h, f = cfg.hidden_size, cfg.ffn_size
        self.swiglu = cfg.swiglu
        stacked = 2 if self.swiglu else 1
        self.fc1 = ColumnParallelLinear(h, stacked * f, name=f"{name}.fc1", stride=stacked,
                                        init_std=ctx.init_std, bias=cfg.add_bias,
                                        **ctx.linear_kwargs())
        self.fc2 = RowParallelLinear(f, h, name=f"{name}.fc2", init_std=ctx.output_init_std,
                                     bias=cfg.add_bias, **ctx.linear_kwargs())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up = self.fc1(x)  # [s, b, f/tp] (or [s, b, 2f/tp] with SwiGLU)
        if self.swiglu:
            gate, up = up.chunk(2, dim=-1)
            return self.fc2(F.silu(gate) * up)
        return self.fc2(F.gelu(up, approximate="tanh"))
