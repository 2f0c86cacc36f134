"""The allocator's peak at each phase of a run (build, first step, steady step, evaluation,
save) against the start-up report's prediction for the same run.

Measured by ``benchmarks.memory_phases.phase_peaks``: each phase's peak bytes above what was in
use before the build (on a GPU the caching allocator's ``max_memory_allocated``; under --cpu
the process's peak resident set). The prediction side is not written yet: its column reads
``n/a`` until ``predicted`` below returns the start-up report's figures.
"""

from __future__ import annotations

import torch

from benchmarks.gpu import single
from benchmarks.gpu.sections import Context, SectionResult
from benchmarks.memory_phases import phase_peaks
from megatron3d import device as devices

MIB = 2**20
STEPS = 3


def predicted(flags: list[str]) -> dict[str, int | None]:
    """PREDICTION GOES HERE (#29, lead engineer): the start-up report's bytes for each phase
    of the run ``flags``; None (shown as n/a) until then."""
    return dict.fromkeys(("build", "first step", "steady step", "evaluation", "save"))


def run(ctx: Context) -> SectionResult:
    dev = ctx.device()
    shape = single.TINY if ctx.cpu else single.GPT_125M
    flags = single.argv(shape, STEPS, "--eval-iters", "1", "--save", str(ctx.work / "ckpt"))
    with single.process_group():
        peaks = phase_peaks(flags, dev, STEPS)
    expected = predicted(flags)
    rows = ["| phase | measured peak (MiB above the start) | predicted (MiB) |",
            "| --- | --- | --- |"]
    for phase, measured in peaks.items():
        guess = expected.get(phase)
        rows.append(f"| {phase} | {measured / MIB:,.1f} | "
                    f"{'n/a' if guess is None else f'{guess / MIB:,.1f}'} |")
    what = ("the CUDA caching allocator's peak allocated bytes" if dev.type == "cuda"
            else "the process's peak resident set (--cpu)")
    head = (f"{devices.describe(dev)}; bf16; {shape.describe()}; {STEPS} steps, one "
            f"evaluation batch, one save. Measured: {what}.")
    return SectionResult("\n".join([head, "", *rows]),
                         {"shape": shape.describe(), "measured_bytes": peaks,
                          "predicted_bytes": expected, "measured": what,
                          "torch": torch.__version__},
                         verdict=f"steady step {peaks['steady step'] / MIB:,.0f} MiB; "
                         "prediction n/a")
