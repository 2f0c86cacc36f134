"""Optional NVIDIA apex kernels with plain-torch fallbacks, and the AdamW every run uses.

apex is not on PyPI, so it is probed once at import; every caller gets the same math either
way. The fused norms are used only on CUDA tensors: the tests (CPU) always run the fallbacks,
which are the reference. AdamW is torch's fused kernel on every device, never apex's
FusedAdam: it is as fast on GPUs, it skips a step on the device when told through
``found_inf`` (params, moments and step untouched; see ``optim/mixed_precision.py``), and it
keeps its step per parameter where checkpoints look for it.
"""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F  # noqa: N812


def _probe(module: str, name: str):
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


_APEX_LAYER_NORM = _probe("apex.normalization.fused_layer_norm", "fused_layer_norm_affine")
_APEX_RMS_NORM = _probe("apex.normalization.fused_layer_norm", "fused_rms_norm_affine")


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               eps: float) -> torch.Tensor:
    if _APEX_LAYER_NORM is not None and x.is_cuda and bias is not None:
        return _APEX_LAYER_NORM(x, weight, bias, weight.shape, eps)
    return F.layer_norm(x, weight.shape, weight, bias, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if _APEX_RMS_NORM is not None and x.is_cuda:
        return _APEX_RMS_NORM(x, weight, weight.shape, eps)
    # Normalise in fp32 so bf16 activations do not lose the mean of squares.
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return normed.to(x.dtype) * weight


def adamw(param_groups: list[dict], lr: float, betas: tuple[float, float],
          eps: float) -> torch.optim.Optimizer:
    """torch's fused AdamW (decoupled weight decay), on CPU and CUDA alike: one code path,
    the one the tests check."""
    return torch.optim.AdamW(param_groups, lr=lr, betas=betas, eps=eps, fused=True)
