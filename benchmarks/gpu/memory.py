"""The allocator's peak at each phase of a run (build, first step, steady step, evaluation,
save) against the start-up report's prediction for the same run.

Measured by ``benchmarks.memory_phases.phase_peaks``: each phase's peak bytes above what was in
use before the build (on a GPU the caching allocator's ``max_memory_allocated``; under --cpu
the peak of tensor storage, the process's peak resident set beside it). Predicted by
``benchmarks.memory_phases.predicted``: the start-up report's model (``accounting/peak.py``).
"""

from __future__ import annotations

import torch

from benchmarks import memory_phases
from benchmarks.gpu import single
from benchmarks.gpu.sections import Context, SectionResult
from megatron3d import device as devices

MIB = 2**20
STEPS = 3


def run(ctx: Context) -> SectionResult:
    dev = ctx.device()
    shape = single.TINY if ctx.cpu else single.GPT_125M
    flags = single.argv(shape, STEPS, "--eval-iters", "1", "--save", str(ctx.work / "ckpt"))
    with single.process_group():
        peaks = memory_phases.phase_peaks(flags, dev, STEPS)
    expected = memory_phases.predicted(flags, 1, STEPS, dev.type)
    measured = {phase: peaks.get(f"{phase} tensors", peaks[phase]) for phase in expected}
    rows = ["| phase | measured peak (MiB above the start) | predicted (MiB) | measured / "
            "predicted |", "| --- | --- | --- | --- |"]
    for phase, guess in expected.items():
        rows.append(f"| {phase} | {measured[phase] / MIB:,.1f} | {guess / MIB:,.1f} | "
                    f"{measured[phase] / guess:.2f} |")
    what = ("the CUDA caching allocator's peak allocated bytes" if dev.type == "cuda"
            else "the peak of tensor storage (--cpu)")
    head = (f"{devices.describe(dev)}; bf16; {shape.describe()}; {STEPS} steps, one "
            f"evaluation batch, one save. Measured: {what}.")
    return SectionResult("\n".join([head, "", *rows]),
                         {"shape": shape.describe(), "measured_bytes": measured,
                          "process_bytes": peaks, "predicted_bytes": expected, "measured": what,
                          "torch": torch.__version__},
                         verdict=_verdict(measured, expected))


def _verdict(measured: dict[str, int], expected: dict[str, int]) -> str:
    """The steady step's peak and its ratio to the prediction."""
    step, guess = measured["steady step"], expected["steady step"]
    return f"steady step {step / MIB:,.0f} MiB, {step / guess:.2f}x the prediction"
