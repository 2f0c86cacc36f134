"""megatron3d with compiled layers (``--compile``) against itself eager, bf16 on one device:
the step time ratio (target <= 0.90), the compile's cost in the warm-up (cold, into an empty
cache in the section's scratch directory; under --cpu into the process's cache) and the first
steps' losses, which must agree to bf16 rounding (the same model and batches; inductor fuses,
so the roundings differ)."""

from __future__ import annotations

import gc

from benchmarks.gpu import single
from benchmarks.gpu.sections import Context, SectionResult
from benchmarks.gpu.speed import megatron3d
from megatron3d import device as devices

RATIO_TARGET = 0.90


def run(ctx: Context) -> SectionResult:
    dev = ctx.device()
    shape, warmup, steps = (single.TINY, 1, 2) if ctx.cpu else (single.GPT_1_3B, 2, 4)
    eager, _, _ = megatron3d(shape, dev, warmup, steps)
    gc.collect()  # the eager run's model and optimizer back to the allocator
    # cold into an empty cache; under --cpu, where no target applies, the process's own
    # (TORCHINDUCTOR_CACHE_DIR, which CI's test shares with the compile tests)
    cache = () if ctx.cpu else ("--compile-cache-dir", str(ctx.work / "compile-cache"))
    compiled, _, _ = megatron3d(shape, dev, warmup, steps, "--compile", *cache)
    ratio = compiled.step_s / eager.step_s
    compile_s = compiled.warmup_s - eager.warmup_s
    loss_gap = abs(compiled.losses[0] - eager.losses[0])
    met = "met" if ratio <= RATIO_TARGET else "MISSED"
    lines = [f"{devices.describe(dev)}; bf16; {shape.describe()}; {warmup} warm-up steps, "
             f"then {steps} timed.", "",
             "| run | s/step | warm-up s | loss: first, last |", "| --- | --- | --- | --- |"]
    lines += [f"| {name} | {t.step_s:.3f} | {t.warmup_s:.1f} | {t.losses[0]:.4f}, "
              f"{t.losses[-1]:.4f} |" for name, t in (("eager", eager), ("--compile", compiled))]
    lines += ["", f"- compiled / eager step time: {ratio:.3f} (target <= {RATIO_TARGET}: {met})",
              f"- {'compile' if ctx.cpu else 'cold compile'}, the warm-up's extra time: "
              f"{compile_s:.1f} s",
              f"- first losses differ by {loss_gap:.4f}"]
    if ctx.cpu:
        lines.append("- --cpu: the numbers only show that the section runs; no targets apply")
    return SectionResult("\n".join(lines),
                         {"shape": shape.describe(), "device": devices.describe(dev),
                          "eager_step_s": eager.step_s, "compiled_step_s": compiled.step_s,
                          "ratio": ratio, "cold_compile_s": compile_s, "loss_gap": loss_gap},
                         verdict=f"compiled {ratio:.2f}x eager's step time, compile "
                                 f"{compile_s:.0f} s")
