"""The optimizer the training step talks to: fp32 master weights, clipping, loss scaling.

It updates the ``Shard`` this rank owns (``zero/shard.py``: everything without ZeRO, a 1/DP
slice of every bucket with ZeRO-1 and ZeRO-3). fp32 model: the master weights are the shard's
own model parameters (no copy). bf16/fp16 model: an fp32 master copy of the shard is updated
and copied back into the low-precision parameters. ``gather_params`` then brings the other
ranks' updated slices (ZeRO-1's all-gather; nothing without ZeRO, and nothing under ZeRO-3,
whose units are gathered when they next run).

A step whose global gradient norm is NaN or Inf is skipped on every rank, decided on the
device: the norm is summed over every axis holding counted gradients (and the flag agreed over
DP replicas without ZeRO), so all ranks decide alike. The flag is handed to torch's fused
AdamW as ``found_inf`` (GradScaler's hook; fused AdamW runs on CPU too, so the tests check the
GPU's code path), whose kernel then leaves parameters, moments and step untouched: no host
sync and no copy of the state; the master -> parameter copy rewrites the same values. fp16
also needs the flag on the host to adjust the loss scale: the one sync per step every fp16
trainer pays.

Adam's step count lives per parameter in torch's optimizers and in the param groups in apex's
FusedAdam; ``local_state``/``load_local_state`` read and restore it in either place.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from megatron3d import kernels
from megatron3d.config import OptimizerConfig, PrecisionConfig
from megatron3d.mpu import comm
from megatron3d.mpu.state import AxisGroup
from megatron3d.optim.grad_clip import clip_, grad_stats
from megatron3d.optim.loss_scaler import LossScaler
from megatron3d.optim.optimizer import ShardView, param_groups

CHECK_PIECE = 16 * 2**20  # elements checked for NaN/Inf at once: a 16 MiB bool temporary


@dataclass(frozen=True)
class StepStats:
    """Per-step optimizer results, left on the device until the log interval."""

    grad_norm: torch.Tensor
    num_zeros: torch.Tensor | None  # None unless counted
    skipped: torch.Tensor  # 1.0 if the step was skipped (non-finite grad norm), else 0.0
    # 1.0 if skipped for a NaN/Inf grad norm in bf16/fp32. Always 0.0 in fp16, whose
    # overflows are routine loss-scale events counted as skipped only.
    nan: torch.Tensor
    loss_scale: float


@dataclass(frozen=True)
class Measured:
    """The accumulated gradients, unscaled and measured, before the step applies them."""

    norm: torch.Tensor  # the global grad norm; NaN on every rank if any replica's was not finite
    num_zeros: torch.Tensor | None
    skip: torch.Tensor  # 1.0 if the norm is not finite (the step would be skipped), else 0.0
    scale: float  # the loss scale the gradients were scaled by


class MixedPrecisionOptimizer:
    def __init__(self, shard: ShardView, optim: OptimizerConfig, precision: PrecisionConfig,
                 norm_axes: list[AxisGroup],
                 gather_params: Callable[[], None] = lambda: None,
                 replica_axes: list[AxisGroup] = (), count_zeros: bool = False) -> None:
        """``norm_axes``: where the counted gradients are spread (model-parallel ranks, and
        DP under ZeRO-1/3). ``replica_axes``: ranks holding copies of the same gradients (DP
        without ZeRO); the skip decision is agreed over them too, so a replica whose gradients
        went non-finite alone cannot step differently from the others. ``count_zeros``:
        count the zero gradient elements each step (--log-num-zeros-in-grad)."""
        self.shard = shard
        self.clip_grad = optim.clip_grad
        self.norm_axes = norm_axes
        self.replica_axes = list(replica_axes)
        self.count_zeros = count_zeros
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
        by_offset = sorted(zip((o for o, _ in self._locals),
                               (p for g in self.groups for p in g["params"]), strict=True),
                           key=lambda pair: pair[0])
        self._starts = [offset for offset, _ in by_offset]
        self._by_offset = [p for _, p in by_offset]
        self.inner = kernels.adamw(self.groups, lr=0.0, betas=(optim.adam_beta1,
                                   optim.adam_beta2), eps=optim.adam_eps)
        self.scaler = LossScaler.from_config(precision) if precision.fp16 else None
        self._counted = shard.counted_grads()
        self._zero = torch.zeros((), device=shard.grads.device)

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
        result["step"] = torch.as_tensor(self.adam_step())
        return result

    def live_state(self, local: int, n: int) -> dict[str, torch.Tensor | None]:
        """The fp32 weights and Adam moments of local elements [local, local + n), which lie
        in one parameter's part, as views of the live tensors (what a save copies to host
        memory, with no copy on the device). A moment is None before Adam's first step."""
        i = bisect.bisect_right(self._starts, local) - 1
        param, at = self._by_offset[i], local - self._starts[i]
        assert at >= 0 and at + n <= param.numel(), "a range across two optimizer tensors"
        state = self.inner.state.get(param, {})
        return {"weight": param.detach().view(-1)[at:at + n],
                **{k: state[k].view(-1)[at:at + n] if k in state else None
                   for k in ("exp_avg", "exp_avg_sq")}}

    def state_not_finite(self) -> torch.Tensor:
        """1.0 on the device if any fp32 weight or Adam moment this rank holds is NaN or
        Inf, else 0.0 (a save refuses such a state, whichever rank writes it). Checked
        ``CHECK_PIECE`` elements at a time, so its temporary stays at most 16 MiB."""
        bad = torch.zeros((), device=self.shard.grads.device)
        for param in self._by_offset:
            state = self.inner.state.get(param, {})
            for t in (param.detach(), *(state[k] for k in ("exp_avg", "exp_avg_sq")
                                        if k in state)):
                for piece in t.view(-1).split(CHECK_PIECE):
                    bad = torch.maximum(bad, (~torch.isfinite(piece).all()).float())
        return bad

    def adam_step(self) -> float:
        """Adam's step: from the per-parameter state if present (torch), else from the param
        groups (apex FusedAdam), else 0 (no step taken yet)."""
        groups = self.inner.param_groups
        states = [self.inner.state.get(p, {}) for g in groups for p in g["params"]]
        per_param = next((s["step"] for s in states if "step" in s), None)
        in_group = next((g["step"] for g in groups if "step" in g), 0.0)
        return float(per_param if per_param is not None else in_group)

    def _step_in_groups(self) -> bool:
        """Whether the inner optimizer counts steps in its param groups: apex's FusedAdam
        does (creating the key at its first step), every torch.optim optimizer counts per
        parameter."""
        return (any("step" in g for g in self.inner.param_groups)
                or not type(self.inner).__module__.startswith("torch.optim"))

    def load_local_state(self, state: dict[str, torch.Tensor], weights_only: bool) -> None:
        """Install what ``local_state`` returned (possibly from another layout, resharded by
        the caller). The low-precision parameters are cast from the fp32 weights. Adam's
        moments become views of ``state``'s moment buffers, which this takes over (the
        caller must not reuse them): a copy would double them while a checkpoint loads."""
        for p in self.shard.pieces:
            part = state["weight"][p.local:p.local + p.end - p.start]
            self._master_part(p.start, p.end, p.local).copy_(part)
            self.shard.param_part(p.start, p.end, p.local).copy_(part)
        self.gather_params()
        in_groups = self._step_in_groups()
        self.inner.state.clear()
        for group in self.inner.param_groups:
            current = group.pop("step", None)
            if in_groups and not weights_only:
                group["step"] = _group_step(current, state["step"])
        if weights_only:
            return
        params = [(p, g.get("fused") or g.get("capturable"))
                  for g in self.inner.param_groups for p in g["params"]]
        for (p, on_device), (local, n) in zip(params, self._locals, strict=True):
            self.inner.state[p] = {
                "exp_avg": state["exp_avg"][local:local + n].view_as(p),
                "exp_avg_sq": state["exp_avg_sq"][local:local + n].view_as(p)}
            if not in_groups:  # fused/capturable Adam keeps its step on the device
                self.inner.state[p]["step"] = state["step"].to(
                    device=p.device if on_device else "cpu", dtype=torch.float32, copy=True)

    def params_norm(self) -> torch.Tensor:
        """The L2 norm of the fp32 weights, each logical element once (as the grad norm
        counts gradients), on the device; a collective over the norm axes, so every rank
        calls it at the same iterations."""
        counted = [self._master_part(lo, hi, local)
                   for seg, lo, hi, local in self.shard.segment_parts() if seg.counted]
        return grad_stats(counted, self.norm_axes, self.shard.grads.device).norm

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank: fp32 master copy and Adam moments."""
        master = 0 if self.master is None else self.master.numel() * 4
        moments = sum(t.numel() * t.element_size() for state in self.inner.state.values()
                      for t in state.values() if torch.is_tensor(t) and t.dim() > 0)
        return master + moments

    def _nonfinite_anywhere(self, norm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(flag, norm): flag 1.0 if the global grad norm is NaN/Inf on any replica, else 0.0,
        on the device. Ranks sharing counted gradients already see one norm; replicas compute
        theirs from their own copy, so the flag is agreed here (no host sync), and a replica
        whose own norm was finite reports NaN, so every rank reports the step alike."""
        flag = (~torch.isfinite(norm)).float().reshape(1)
        for axis in self.replica_axes:
            flag = comm.all_reduce(flag, axis, op=comm.MAX)
        flag = flag.reshape(())
        return flag, torch.where((flag != 0) & torch.isfinite(norm), torch.nan, norm)

    def step(self, lr: float) -> StepStats:
        """Unscale, measure, clip and apply the accumulated gradients at learning rate lr;
        skip the step on every rank if the global grad norm is not finite."""
        return self.apply(lr, self.measure())

    def measure(self) -> Measured:
        """Unscale the accumulated gradients and measure them (the global norm, agreed over
        replicas): the first half of ``step``, after which a caller may still decide not to
        ``apply`` (--rerun-on-bad-step judges the step in between)."""
        scale = self.loss_scale
        if scale != 1.0:
            self.shard.grads.mul_(1.0 / scale)
        stats = grad_stats(self._counted, self.norm_axes, self.shard.grads.device,
                           self.count_zeros)
        skip, norm = self._nonfinite_anywhere(stats.norm)
        return Measured(norm, stats.num_zeros, skip, scale)

    def not_applied(self, measured: Measured) -> StepStats:
        """The stats of a measured step that is not applied (counted as skipped); nothing
        changes, the loss scale included."""
        nan = self._zero if self.scaler is not None else measured.skip
        return StepStats(measured.norm, measured.num_zeros, torch.ones_like(self._zero), nan,
                         measured.scale)

    def apply(self, lr: float, measured: Measured) -> StepStats:
        """Clip and apply the gradients ``measure`` measured, at learning rate lr (skipped on
        every rank if their norm is not finite)."""
        grads, norm, skip, scale = self.shard.grads, measured.norm, measured.skip, measured.scale
        if self.scaler is not None:
            overflow = bool(skip)  # the one fp16 host sync per step
            self.scaler.update(overflow)
            if overflow:
                return StepStats(norm, measured.num_zeros, skip, self._zero, scale)
        clip_(grads, self.clip_grad, norm)
        for group in self.inner.param_groups:
            group["lr"] = lr
        self.inner.found_inf = skip  # 1.0: the fused kernel leaves params, moments, step as is
        self.inner.step()
        if self.master is not None:
            for piece in self.shard.pieces:
                self.shard.param_part(piece.start, piece.end, piece.local).copy_(
                    self._master_part(piece.start, piece.end, piece.local))
        self.gather_params()
        nan = self._zero if self.scaler is not None else skip
        return StepStats(norm, measured.num_zeros, skip, nan, scale)


def _group_step(current: Any, step: torch.Tensor) -> Any:
    """A loaded step in the type a param group holds it: apex keeps an int, or a device
    tensor when capturable."""
    if torch.is_tensor(current):
        return torch.full_like(current, float(step))
    return int(step)
