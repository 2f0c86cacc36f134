"""The sections of the GPU check, in the order they run, with what each costs on one H100.

Each section is a module with ``run(ctx) -> SectionResult``; ``section.py`` runs one in its own
process, so a CUDA error, a crash or a hang in one leaves the others to run. The estimates add
up to the 9 minutes the check is budgeted (one device call of at most 10, after the machine's
start, in a 15-minute device session; estimates, not yet measured on a GPU); the timeouts are
what each may take at most (the check's budget caps them too, and a section that no longer
fits is skipped, saying so).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Plan:
    """``estimate_s``: seconds on one H100 (start-up of its process included);
    ``timeout_s``: the most it may take; ``checks``: one line for the report."""

    estimate_s: int
    timeout_s: int
    checks: str


PLANS: dict[str, Plan] = {
    "environment": Plan(10, 60, "the machine, torch, CUDA, transformers and the device's peak"),
    "cuda_tests": Plan(130, 240, "the test suite's tests marked `cuda`, on the GPU "
                       "(MEGATRON3D_TEST_DEVICE=cuda)"),
    "ranks": Plan(60, 120, "several ranks on the GPU(s) (gloo with one GPU, NCCL with one per "
                  "rank) train the single-GPU model in fp32"),
    "speed": Plan(150, 240, "bf16 training of a 1.3B GPT: megatron3d against transformers' "
                  "GPT-2 in a plain PyTorch loop, eager and compiled"),
    "compiled": Plan(100, 200, "megatron3d with --compile against itself eager: step time "
                     "and the cold compile, bf16, the 1.3B GPT"),
    "memory": Plan(45, 90, "the allocator's peak at each phase against the start-up report's "
                   "prediction"),
    "profile": Plan(45, 90, "one training step under torch.profiler: top kernels, the trace"),
}
BUDGET_S = 540  # 9 minutes on one H100
GPU_SHAPES_NOTE = "shapes: the GPU's; --cpu runs each section at tiny shapes on the CPU"


@dataclass(frozen=True)
class Context:
    """What a section is given: ``cpu`` (the --cpu mode: tiny shapes, the CPU), ``out`` (the
    report's directory, for files beside it), ``work`` (scratch, removed afterwards)."""

    cpu: bool
    out: Path
    work: Path

    def device(self) -> Any:
        """The torch device the section runs on: the CPU under --cpu, else this process's
        GPU (an error without one: a GPU check on the CPU would report nothing true)."""
        import torch  # here, so that the driver starts without importing torch

        from megatron3d import device as devices

        if self.cpu:
            return torch.device("cpu")
        if not devices.accelerator_available():
            raise RuntimeError("torch sees no GPU: pass --cpu on a machine without one")
        return devices.set_device(0)


@dataclass
class SectionResult:
    """A section's findings: ``markdown`` for report.md, ``data`` for report.json; ``files``:
    what it wrote under ``out``; ``verdict``: one line for the summary table. A target
    missed is a finding, not a failure."""

    markdown: str
    data: dict[str, Any] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    verdict: str = ""
