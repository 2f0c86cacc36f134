"""The device the tests build on, read in this one place: the CPU, unless
``MEGATRON3D_TEST_DEVICE=cuda`` (``scripts/gpu_check.sh`` sets it to run the tests marked
``cuda`` on the GPU: ranks of a test then share the GPUs round robin, over gloo)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from megatron3d import device as devices

ENV = "MEGATRON3D_TEST_DEVICE"


def on_gpu() -> bool:
    """Whether this test run builds on the GPU (``ENV`` says cuda and one is there)."""
    wanted = os.environ.get(ENV, "cpu")
    if wanted not in ("cpu", "cuda"):
        raise ValueError(f"{ENV}={wanted!r}: expected cpu or cuda")
    if wanted == "cuda" and not devices.accelerator_available():
        raise RuntimeError(f"{ENV}=cuda but torch sees no GPU")
    return wanted == "cuda"


def rank_device() -> torch.device:
    """This process's device: under torch.distributed, its rank's GPU (made current)."""
    if not on_gpu():
        return torch.device("cpu")
    rank = dist.get_rank() if dist.is_initialized() else 0
    return devices.set_device(rank)
