"""LayerNorm and RMSNorm with parameters marked no-decay and TP-replicated."""

from __future__ import annotations

import torch
from torch import nn

from megatron3d import kernels
from megatron3d.model.context import LayerContext
from megatron3d.mpu.init import Constant, fill
from megatron3d.mpu.meta import ParamMeta, set_meta


def _param(size: int, value: float, name: str, sequence_parallel: bool,
           opts: dict) -> nn.Parameter:
    init = Constant(value)
    return set_meta(nn.Parameter(fill(init, torch.empty(size, **opts))),
                    ParamMeta(name=name, no_weight_decay=True,
                              sequence_parallel=sequence_parallel, init=init))


class Norm(nn.Module):
    """``--normalization layernorm|rmsnorm`` over the hidden dimension (of a sequence shard
    under sequence parallelism, hence the partial gradients)."""

    def __init__(self, ctx: LayerContext, name: str) -> None:
        super().__init__()
        h, kind = ctx.cfg.hidden_size, ctx.cfg.normalization
        opts = {"dtype": ctx.params_dtype, "device": ctx.param_device}
        self.eps = ctx.cfg.layernorm_epsilon
        self.rms = kind == "rmsnorm"
        sp = ctx.sequence_parallel
        self.weight = _param(h, 1.0, f"{name}.weight", sp, opts)
        self.bias = None if self.rms else _param(h, 0.0, f"{name}.bias", sp, opts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rms:
            return kernels.rms_norm(x, self.weight, self.eps)
        return kernels.layer_norm(x, self.weight, self.bias, self.eps)
