"""Run Megatron-Core 0.16.1 on CPU/gloo: the CUDA device calls it makes are redirected.

Its parallel state and tensor-parallel layers work on CPU as they are; GPTModel, the
pipeline schedules, DDP and the distributed optimizer ask CUDA for the current device, make
small tensors with ``device="cuda"``, or synchronise. Each patch below says why it is there.
``apply()`` runs before anything else of megatron.core is imported, and only inside a peer
worker process: nothing here touches megatron3d or the default test run.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable
from typing import Any

import torch

_FACTORIES = frozenset({"tensor", "zeros", "ones", "empty", "full", "arange"})
_LITERAL_CUDA_MODULES = (
    "megatron.core.optimizer.optimizer",  # FP32Optimizer's scale of 1.0, found-inf flags
    "megatron.core.optimizer.clip_grads",  # the grad norm and its overflow buffer, each step
    "megatron.core.pipeline_parallel.schedules",  # the token count of each step
    "megatron.core.distributed.param_and_grad_buffer",  # a communicator warm-up tensor
    "megatron.core.utils",  # the torch fallback of apex's multi-tensor L2 norm (no apex here)
)
"""Modules that write ``device="cuda"`` literally; they see ``_CpuTorch`` as ``torch``."""


def _on_cpu(factory: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def make(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        if device is not None and torch.device(device).type == "cuda":
            device = "cpu"
        return factory(*args, device=device, **kwargs)

    return make


class _CpuTorch:
    """``torch`` for one module, except that its tensor factories asked for a CUDA tensor
    make a CPU one. Only calls written in that module pass through here (a handful per
    step), so the patch costs nothing measurable."""

    def __getattr__(self, name: str) -> Any:
        attr = getattr(torch, name)
        return _on_cpu(attr) if name in _FACTORIES else attr


def _cpu_device() -> str:
    return "cpu"


def _unchanged(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return tensor


def _no_op(*args: object, **kwargs: object) -> None:
    return None


_tensor_type = torch.Tensor.type


def _cuda_type_name(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """``Tensor.type()`` with no argument answers "torch.cuda.FloatTensor" for a CPU float
    tensor; a conversion (``type(dtype)``) is unchanged."""
    if args or kwargs:
        return _tensor_type(tensor, *args, **kwargs)
    return _tensor_type(tensor).replace("torch.", "torch.cuda.", 1)


def apply() -> None:
    """Redirect the CUDA device calls Megatron-Core makes to the CPU."""
    # Buffers, p2p shape messages and optimizer shards are allocated with
    # device=torch.cuda.current_device(): "cpu" is a valid device argument there.
    torch.cuda.current_device = _cpu_device
    # The distributed optimizer and the optimizers' state loading move tensors with .cuda():
    # on a CPU run they already are where they belong.
    torch.Tensor.cuda = _unchanged
    # Timers and the schedules synchronise the device between phases: nothing to wait for.
    torch.cuda.synchronize = _no_op
    # The optimizers and gradient clipping check parameters and gradients by their legacy
    # type string ("torch.cuda.FloatTensor") and refuse any other: in this CPU-only process
    # the CPU tensors answer with the CUDA spelling of their type.
    torch.Tensor.type = _cuda_type_name
    proxy = _CpuTorch()
    for name in _LITERAL_CUDA_MODULES:
        importlib.import_module(name).torch = proxy


def patch_rng_tracker() -> None:
    """Dropout is 0 in this comparison, so the model-parallel RNG fork around attention
    dropout (which swaps CUDA generator states) has nothing to do: make it a plain context."""
    from megatron.core.tensor_parallel import random as mcore_random

    tracker = mcore_random.get_cuda_rng_tracker()
    tracker.fork = lambda *args, **kwargs: contextlib.nullcontext()
