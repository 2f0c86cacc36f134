"""The machine the numbers come from: device, GPUs, versions and the peak MFU is taken
against."""

from __future__ import annotations

import importlib.metadata
import platform
import shutil
import subprocess

import torch

from benchmarks.gpu.sections import Context, SectionResult
from megatron3d import device as devices


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _nvidia_smi() -> str:
    """The GPUs as the driver lists them, or why not."""
    if shutil.which("nvidia-smi") is None:
        return "no nvidia-smi"
    done = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,"
                           "clocks.max.sm", "--format=csv,noheader"], capture_output=True,
                          text=True, check=False, timeout=30)
    return (done.stdout or done.stderr).strip()


def run(ctx: Context) -> SectionResult:
    dev = ctx.device()
    peak = devices.peak_tflops(dev)
    data = {"device": devices.describe(dev), "gpus": devices.gpu_count(),
            "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "transformers": _version("transformers"),
            "pytest": _version("pytest"), "peak_bf16_tflops": peak,
            "nvidia_smi": _nvidia_smi() if dev.type == "cuda" else "n/a (CPU)"}
    rows = ["| what | value |", "| --- | --- |"]
    rows += [f"| {k} | {v} |" for k, v in data.items()]
    return SectionResult("\n".join(rows), data, verdict=data["device"])
