"""The optimizer the training step talks to: fp32 master weights, clipping, loss scaling.

fp32 model: the master weights are the model's own flat buffer (no copy). bf16/fp16 model: an
fp32 master copy is updated and then copied back into the low-precision parameters in one
flat copy. Gradients always arrive in the fp32 grad buffer (see ``FlatBuffers``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron3d import kernels
from megatron3d.config import OptimizerConfig, PrecisionConfig
from megatron3d.mpu.state import AxisGroup
from megatron3d.optim.flat_buffers import FlatBuffers
from megatron3d.optim.grad_clip import clip_, grad_stats
from megatron3d.optim.loss_scaler import LossScaler
from megatron3d.optim.optimizer import param_groups


@dataclass(frozen=True)
class StepStats:
    """Per-step optimizer results, left on the device until the log interval."""

    grad_norm: torch.Tensor
    num_zeros: torch.Tensor
    skipped: torch.Tensor  # 1.0 if the step was skipped (fp16 overflow), else 0.0
    loss_scale: float


class MixedPrecisionOptimizer:
    def __init__(self, buffers: FlatBuffers, optim: OptimizerConfig,
                 precision: PrecisionConfig, norm_axes: list[AxisGroup]) -> None:
        self.buffers = buffers
        self.clip_grad = optim.clip_grad
        self.norm_axes = norm_axes
        low_precision = buffers.params_dtype != torch.float32
        self.master = buffers.params.float() if low_precision else buffers.params
        self.groups = param_groups(buffers, self.master, optim.weight_decay)
        self.inner = kernels.adamw(self.groups, lr=0.0, betas=(optim.adam_beta1,
                                   optim.adam_beta2), eps=optim.adam_eps)
        self.scaler = LossScaler.from_config(precision) if precision.fp16 else None
        self._not_skipped = torch.zeros((), device=buffers.grads.device)

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def zero_grad(self) -> None:
        self.buffers.zero_grad()

    def step(self, lr: float) -> StepStats:
        """Unscale, measure, clip and apply the accumulated gradients at learning rate lr."""
        grads = self.buffers.grads
        scale = self.loss_scale
        if scale != 1.0:
            grads.mul_(1.0 / scale)
        stats = grad_stats(self.buffers.counted_grads, self.norm_axes)
        if self.scaler is not None:
            found_inf = not bool(torch.isfinite(stats.norm))  # the one fp16 host sync
            self.scaler.update(found_inf)
            if found_inf:
                return StepStats(stats.norm, stats.num_zeros, self._not_skipped + 1.0, scale)
        clip_(grads, self.clip_grad, stats.norm)
        for group in self.inner.param_groups:
            group["lr"] = lr
        self.inner.step()
        if self.master is not self.buffers.params:
            self.buffers.params.copy_(self.master)
        return StepStats(stats.norm, stats.num_zeros, self._not_skipped, scale)
