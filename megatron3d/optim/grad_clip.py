"""Global gradient norm, zero count and clipping, all kept on the device.

Each rank measures the gradients it counts (see ``FlatBuffers``/``Shard``); the squared norm
and the zero count are summed over the given axes (model-parallel ranks, ZeRO shards), so
every rank gets the norm of the whole logical model. Clipping multiplies by min(1, max/norm)
on the device, so no host sync is needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron3d.mpu import comm
from megatron3d.mpu.state import AxisGroup


@dataclass(frozen=True)
class GradStats:
    norm: torch.Tensor  # fp32 scalar
    num_zeros: torch.Tensor | None  # fp32 scalar; None when not counted


def grad_stats(counted: list[torch.Tensor], axes: list[AxisGroup], device: torch.device,
               count_zeros: bool = False) -> GradStats:
    """Norm (and with ``count_zeros`` the zero count) of the tensors counted on this rank,
    summed over ``axes``. Counting zeros costs a kernel per tensor: only when it is logged."""
    both = torch.zeros(2 if count_zeros else 1, dtype=torch.float32, device=device)
    if counted:
        norms = torch._foreach_norm(counted)
        both[0] = torch.stack(norms).square().sum()
        if count_zeros:
            numel = sum(g.numel() for g in counted)
            both[1] = numel - torch.stack([torch.count_nonzero(g) for g in counted]).sum()
    for axis in axes:
        both = comm.all_reduce(both, axis)
    return GradStats(norm=both[0].sqrt(), num_zeros=both[1] if count_zeros else None)


def clip_(grads: torch.Tensor, max_norm: float, norm: torch.Tensor) -> None:
    """Scale ``grads`` in place so their norm is at most ``max_norm`` (0 disables)."""
    if max_norm > 0.0:
        grads.mul_((max_norm / (norm + 1e-6)).clamp(max=1.0))
