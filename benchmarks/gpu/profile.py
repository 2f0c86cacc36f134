"""One training step of the speed section's model under torch.profiler: the kernels that
took the most device time (CPU operators under --cpu) and the trace, for chrome://tracing or
Perfetto, gzipped beside the report."""

from __future__ import annotations

import gzip
import shutil

from torch.profiler import ProfilerActivity, profile

from benchmarks.gpu import single
from benchmarks.gpu.sections import Context, SectionResult
from megatron3d import device as devices

TRACE = "profile-trace.json.gz"
TOP = 15
WARMUP = 2  # steps before the profiled one (the first allocates and tunes)


def _self_time_us(event, on_device: bool) -> float:
    """An operator's own time: on the device (kernels) or on the host."""
    if not on_device:
        return event.self_cpu_time_total
    for name in ("self_device_time_total", "self_cuda_time_total"):  # torch's names over time
        if hasattr(event, name):
            return getattr(event, name)
    return 0.0


def run(ctx: Context) -> SectionResult:
    dev = ctx.device()
    shape = single.TINY if ctx.cpu else single.GPT_1_3B
    on_device = dev.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_device else [])
    prof = profile(activities=activities)

    def on_step(iteration: int, _result: object) -> None:
        if iteration == WARMUP:
            devices.synchronize(dev)
            prof.start()

    with single.process_group():
        trainer, _ = single.build(single.argv(shape, WARMUP + 1), dev, on_step)
        trainer.run()
        devices.synchronize(dev)
        prof.stop()
    events = sorted(prof.key_averages(), key=lambda e: _self_time_us(e, on_device),
                    reverse=True)
    total = sum(_self_time_us(e, on_device) for e in events) or 1.0
    rows = [{"name": e.key, "calls": e.count, "self_us": _self_time_us(e, on_device),
             "share": _self_time_us(e, on_device) / total} for e in events[:TOP]]
    raw = ctx.work / "trace.json"
    prof.export_chrome_trace(str(raw))
    with open(raw, "rb") as src, gzip.open(ctx.out / TRACE, "wb") as dst:
        shutil.copyfileobj(src, dst)
    where = "device (kernels)" if on_device else "host (CPU operators)"
    lines = [f"{devices.describe(dev)}; bf16; {shape.describe()}; step {WARMUP + 1}. Self "
             f"time on the {where}: {total / 1e3:,.1f} ms in all; trace: `{TRACE}`.", "",
             "| name | calls | self ms | share |", "| --- | --- | --- | --- |"]
    lines += [f"| `{r['name'][:90]}` | {r['calls']} | {r['self_us'] / 1e3:,.2f} | "
              f"{100 * r['share']:.1f}% |" for r in rows]
    return SectionResult("\n".join(lines), {"top": rows, "total_self_us": total,
                                            "where": where}, files=[TRACE],
                         verdict=f"top: {rows[0]['name'][:40]} {100 * rows[0]['share']:.0f}%")
