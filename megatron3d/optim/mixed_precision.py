"""The optimizer the training step talks to: fp32 master weights, clipping, loss scaling.

It updates the ``Shard`` this rank owns (``zero/shard.py``: everything without ZeRO, a 1/DP
slice of every bucket with ZeRO-1 and ZeRO-3). fp32 model: the master weights are the shard's
own model parameters (no copy). bf16/fp16 model: an fp32 master copy of the shard is updated
and copied back into the low-precision parameters. ``gather_params`` then brings the other
ranks' updated slices (ZeRO-1's all-gather; nothing without ZeRO, and nothing under ZeRO-3,
whose units are gathered when they next run).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron3d import kernels
from megatron3d.config import OptimizerConfig, PrecisionConfig
from megatron3d.mpu import comm
from megatron3d.mpu.state import AxisGroup
from megatron3d.optim.grad_clip import clip_, grad_stats
from megatron3d.optim.loss_scaler import LossScaler
from megatron3d.optim.optimizer import ShardView, param_groups


@dataclass(frozen=True)
class StepStats:
    """Per-step optimizer results, left on the device until the log interval."""

    grad_norm: torch.Tensor
    num_zeros: torch.Tensor
    skipped: torch.Tensor  # 1.0 if the step was skipped (fp16 overflow), else 0.0
    loss_scale: float


class MixedPrecisionOptimizer:
    def __init__(self, shard: ShardView, optim: OptimizerConfig, precision: PrecisionConfig,
                 norm_axes: list[AxisGroup],
                 gather_params: Callable[[], None] = lambda: None,
                 replica_axes: list[AxisGroup] = ()) -> None:
        """``norm_axes``: where the counted gradients are spread (model-parallel ranks, and
        DP under ZeRO-1/3). ``replica_axes``: ranks holding copies of the same gradients (DP
        without ZeRO); the fp16 skip decision is agreed over them too, so a replica that
        overflows alone cannot step differently from the others."""
        self.shard = shard
        self.clip_grad = optim.clip_grad
        self.norm_axes = norm_axes
        self.replica_axes = list(replica_axes)
        self.gather_params = gather_params
        self.master = None  # fp32 models update their own parameters
        if shard.params_dtype != torch.float32:
            self.master = torch.empty(shard.numel, dtype=torch.float32,
                                      device=shard.grads.device)
            for piece in shard.pieces:
                self._master_part(piece.start, piece.end, piece.local).copy_(
                    shard.param_part(piece.start, piece.end, piece.local))
        self.groups = param_groups(shard, self._master_part, optim.weight_decay)
        # Where each optimizer tensor sits in local coordinates, in param_groups order.
        self._locals = [(int(p.grad.data_ptr() - shard.grads.data_ptr()) // 4, p.numel())
                        for g in self.groups for p in g["params"]]
        self.inner = kernels.adamw(self.groups, lr=0.0, betas=(optim.adam_beta1,
                                   optim.adam_beta2), eps=optim.adam_eps)
        self.scaler = LossScaler.from_config(precision) if precision.fp16 else None
        self._counted = shard.counted_grads()
        self._not_skipped = torch.zeros((), device=shard.grads.device)

    def _master_part(self, start: int, end: int, local: int) -> torch.Tensor:
        if self.master is None:
            return self.shard.param_part(start, end, local)
        return self.master[local:local + end - start]

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def zero_grad(self) -> None:
        self.shard.zero_grad()

    def local_state(self) -> dict[str, torch.Tensor]:
        """The fp32 weights and Adam moments of this rank's shard, in local coordinates
        (what a checkpoint stores), and Adam's step count."""
        weights = torch.cat([self._master_part(p.start, p.end, p.local).float()
                             for p in self.shard.pieces])
        result = {"weight": weights}
        params = [p for g in self.inner.param_groups for p in g["params"]]
        for key in ("exp_avg", "exp_avg_sq"):
            result[key] = torch.zeros(self.shard.numel, dtype=torch.float32,
                                      device=weights.device)
            for p, (local, n) in zip(params, self._locals, strict=True):
                if p in self.inner.state:
                    result[key][local:local + n] = self.inner.state[p][key].view(-1)
        first = self.inner.state.get(params[0], {}) if params else {}
        result["step"] = torch.as_tensor(float(first.get("step", 0.0)))
        return result

    def load_local_state(self, state: dict[str, torch.Tensor], weights_only: bool) -> None:
        """Install what ``local_state`` returned (possibly from another layout, resharded by
        the caller). The low-precision parameters are cast from the fp32 weights."""
        for p in self.shard.pieces:
            part = state["weight"][p.local:p.local + p.end - p.start]
            self._master_part(p.start, p.end, p.local).copy_(part)
            self.shard.param_part(p.start, p.end, p.local).copy_(part)
        self.gather_params()
        if weights_only:
            self.inner.state.clear()
            return
        params = [(p, g.get("fused") or g.get("capturable"))
                  for g in self.inner.param_groups for p in g["params"]]
        for (p, on_device), (local, n) in zip(params, self._locals, strict=True):
            self.inner.state[p] = {  # fused/capturable Adam keeps its step on the device
                "step": state["step"].to(device=p.device if on_device else "cpu",
                                         dtype=torch.float32, copy=True),
                "exp_avg": state["exp_avg"][local:local + n].clone().view_as(p),
                "exp_avg_sq": state["exp_avg_sq"][local:local + n].clone().view_as(p)}

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank: fp32 master copy and Adam moments."""
        master = 0 if self.master is None else self.master.numel() * 4
        moments = sum(t.numel() * t.element_size() for state in self.inner.state.values()
                      for t in state.values() if torch.is_tensor(t) and t.dim() > 0)
        return master + moments

    def _overflow_anywhere(self, norm: torch.Tensor) -> bool:
        """Whether any rank's gradients hold an inf/NaN (the one fp16 host sync per step)."""
        flag = (~torch.isfinite(norm)).float().reshape(1)
        for axis in self.replica_axes:
            flag = comm.all_reduce(flag, axis, op=comm.MAX)
        return bool(flag)

    def step(self, lr: float) -> StepStats:
        """Unscale, measure, clip and apply the accumulated gradients at learning rate lr."""
        grads = self.shard.grads
        scale = self.loss_scale
        if scale != 1.0:
            grads.mul_(1.0 / scale)
        stats = grad_stats(self._counted, self.norm_axes, grads.device)
        if self.scaler is not None:
            found_inf = self._overflow_anywhere(stats.norm)
            self.scaler.update(found_inf)
            if found_inf:
                return StepStats(stats.norm, stats.num_zeros, self._not_skipped + 1.0, scale)
        clip_(grads, self.clip_grad, stats.norm)
        for group in self.inner.param_groups:
            group["lr"] = lr
        self.inner.step()
        if self.master is not None:
            for piece in self.shard.pieces:
                self.shard.param_part(piece.start, piece.end, piece.local).copy_(
                    self._master_part(piece.start, piece.end, piece.local))
        self.gather_params()
        return StepStats(stats.norm, stats.num_zeros, self._not_skipped, scale)
