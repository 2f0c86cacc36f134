"""The allocator's peak at each phase of a run (build, first step, steady step, evaluation,
save) against the start-up report's prediction for the same run.

Measured by ``benchmarks.memory_phases.phase_peaks``: each phase's peak bytes above what was in
use before the build (on a GPU the caching allocator's ``max_memory_allocated``; under --cpu
the process's peak resident set). Predicted by ``benchmarks.memory_phases.predicted`` (the
start-up report's model), which the lead engineer is adding: ``predicted`` below is the one
place that reads it, and the column says ``n/a`` while it is not there.
"""

from __future__ import annotations

import torch

from benchmarks import memory_phases
from benchmarks.gpu import single
from benchmarks.gpu.sections import Context, SectionResult
from megatron3d import device as devices

MIB = 2**20
STEPS = 3


def predicted(flags: list[str], device_type: str) -> dict[str, int | None]:
    """THE PREDICTION (#29): the start-up report's bytes for each phase of the one-rank run
    ``flags``, from ``memory_phases.predicted`` once the prediction side is merged; None
    (shown as n/a) until then."""
    model = getattr(memory_phases, "predicted", None)
    if model is None:
        return dict.fromkeys(("build", "first step", "steady step", "evaluation", "save"))
    return model(flags, 1, STEPS, device_type)


def run(ctx: Context) -> SectionResult:
    dev = ctx.device()
    shape = single.TINY if ctx.cpu else single.GPT_125M
    flags = single.argv(shape, STEPS, "--eval-iters", "1", "--save", str(ctx.work / "ckpt"))
    with single.process_group():
        peaks = memory_phases.phase_peaks(flags, dev, STEPS)
    expected = predicted(flags, dev.type)
    rows = ["| phase | measured peak (MiB above the start) | predicted (MiB) | measured / "
            "predicted |", "| --- | --- | --- | --- |"]
    for phase, measured in peaks.items():
        guess = expected.get(phase)
        cells = ("n/a", "n/a") if not guess else (f"{guess / MIB:,.1f}",
                                                  f"{measured / guess:.2f}")
        rows.append(f"| {phase} | {measured / MIB:,.1f} | {cells[0]} | {cells[1]} |")
    what = ("the CUDA caching allocator's peak allocated bytes" if dev.type == "cuda"
            else "the process's peak resident set (--cpu)")
    head = (f"{devices.describe(dev)}; bf16; {shape.describe()}; {STEPS} steps, one "
            f"evaluation batch, one save. Measured: {what}.")
    return SectionResult("\n".join([head, "", *rows]),
                         {"shape": shape.describe(), "measured_bytes": peaks,
                          "predicted_bytes": expected, "measured": what,
                          "torch": torch.__version__},
                         verdict=_verdict(peaks, expected))


def _verdict(peaks: dict[str, int], expected: dict[str, int | None]) -> str:
    """The steady step's peak, and its ratio to the prediction where there is one."""
    measured, guess = peaks["steady step"], expected.get("steady step")
    ratio = "prediction n/a" if not guess else f"{measured / guess:.2f}x the prediction"
    return f"steady step {measured / MIB:,.0f} MiB, {ratio}"
