"""How idle is each pipeline stage under 1F1B and interleaved 1F1B, against the theory?

With ``p`` stages, ``m`` micro-batches, backward = 2 x forward and free communication, 1F1B
leaves every stage idle for (p - 1) / (m + p - 1) of the step (Narayanan et al. 2021), and
interleaving with ``v`` chunks per stage for (p - 1) / (v m + p - 1); the schedule simulator
(``megatron3d.pipeline.simulate``, forward_cost=1, backward_cost=2) must agree with those
formulas, and both are printed next to the measurement.

For each PP in ``--pp``, m in {PP, 4 x PP} and v in {1} + ``--virtual``, PP gloo processes
(one thread each) build the real trainer (``build_trainer``) for a small fp32 GPT with
``--pipeline-model-parallel-size PP`` (and ``--virtual-pipeline-model-parallel-size v``) and
``Trainer.run`` it as pretrain_gpt.py does (``train_step`` per iteration), timing the steps
after a warm-up. Stages get equal work: 2 blocks each, split by ``--pp-partition-method
type:TransformerLayer`` (uniform over the blocks; the small embedding joins the first stage,
final norm and LM head the last). Plain ``uniform`` would weigh the embedding, norm and head
like blocks and give PP=4 stages of 1 to 3 blocks. The summary checks the interleaved bubble
against its theory plus the overhead measured for 1F1B (time the theory does not see: p2p,
imbalance, core sharing) and against 1F1B's.

Timing: the built engine is switched to a subclass whose ``_forward``/``_backward`` record
(kind, micro-batch, start, end) with ``time.perf_counter`` around the real method, and whose
``forward_backward`` starts with a barrier; each rank times its step from the moment it left
the barrier to the trainer's ``on_step`` hook (after the optimizer). The processes share the
host's monotonic clock, so the parent then moves every rank onto one origin, the first rank
out of the barrier (how much later the last one left is printed). The
pipeline span of a step is the latest stage's end of ``forward_backward``; a stage's idle
fraction is 1 - (time inside Forward and Backward) / span, the median over the timed steps.
Idle time includes the p2p exchanges (theory counts them as free); the gradient sync and
optimizer after ``forward_backward`` are reported apart, not counted as bubble.

On a CPU with fewer cores than stages the processes share cores, so a "busy" interval may
include time the OS gave to another process: the figures are indicative only there. The
``cpu/wall`` column (thread CPU time / wall time inside Forward and Backward) shows how much.
One PNG timeline per (PP, m) is written to ``--out`` (rows = stages, top = stage 0).

    python -m benchmarks.pipeline_bubble
    python -m benchmarks.pipeline_bubble --pp 2 4 8 --hidden 256 --steps 10 --out /tmp/bubble
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from itertools import groupby
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.common import add_model_args, spawn
from benchmarks.png import Canvas, Color
from megatron3d import device as devices
from megatron3d.cli.arguments import parse_args
from megatron3d.config import TrainConfig
from megatron3d.mpu.state import ParallelState
from megatron3d.pipeline.engine import Batch, PipelineEngine
from megatron3d.pipeline.instructions import Backward, Forward
from megatron3d.pipeline.interleaved import interleaved_1f1b
from megatron3d.pipeline.schedule import schedule_for
from megatron3d.pipeline.simulate import simulate
from megatron3d.training.build import Overrides, build_trainer
from megatron3d.training.loop import Hooks
from megatron3d.validation import validate

Trace = dict[str, Any]  # one rank, one step: t0 (absolute), events, fb_end, step_end (from t0)
SHORT = {"InputEmbedding": "emb", "InputNorm": "emb-norm", "TransformerLayer": "block",
         "FinalNorm": "norm", "OutputEmbedding": "head"}


class TimedEngine(PipelineEngine):
    """The engine, recording when each Forward and Backward instruction of a step runs.

    Overriding the private ``_forward``/``_backward`` is acceptable in a benchmark only: it
    measures the engine without changing it (and breaks loudly if they are renamed).
    ``forward_backward`` starts with a barrier, so every stage starts the step together.
    """

    events: list[tuple[str, int, float, float, float]]  # (F|B, mb, start, end, CPU seconds)
    traces: list[Trace]  # the kept steps, times relative to t0
    t0: float
    fb_end: float

    @staticmethod
    def instrument(engine: PipelineEngine) -> TimedEngine:
        """The engine build_trainer made, timed."""
        engine.__class__ = TimedEngine
        assert isinstance(engine, TimedEngine)
        engine.traces = []
        return engine

    def forward_backward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.events = []
        dist.barrier()  # the world is this pipeline: all stages start from here
        self.t0 = time.perf_counter()
        loss = super().forward_backward(*args, **kwargs)
        self.fb_end = time.perf_counter()
        return loss

    def end_step(self, keep: bool) -> None:
        """Called once the step (grad sync and optimizer included) is over."""
        step_end, t0 = time.perf_counter(), self.t0
        if keep:
            self.traces.append({"t0": t0, "fb_end": self.fb_end - t0, "step_end": step_end - t0,
                                "events": [(k, mb, s - t0, e - t0, c)
                                           for k, mb, s, e, c in self.events]})

    def _forward(self, step: Forward, batch: Batch, run: Any, weight: float) -> None:
        start, cpu = time.perf_counter(), time.thread_time()
        super()._forward(step, batch, run, weight)
        self.events.append(("F", step.micro_batch, start, time.perf_counter(),
                            time.thread_time() - cpu))

    def _backward(self, step: Backward, run: Any) -> None:
        start, cpu = time.perf_counter(), time.thread_time()
        super()._backward(step, run)
        self.events.append(("B", step.micro_batch, start, time.perf_counter(),
                            time.thread_time() - cpu))


def _argv(a: argparse.Namespace, pp: int, m: int, v: int) -> list[str]:
    return ["--num-layers", str(a.blocks_per_stage * pp), "--hidden-size", str(a.hidden),
            "--num-attention-heads", str(a.heads), "--seq-length", str(a.seq),
            "--micro-batch-size", str(a.micro_batch), "--global-batch-size",
            str(a.micro_batch * m), "--train-iters", str(a.warmup + a.steps), "--lr", "1e-4",
            "--mock-data", "--vocab-size", str(a.vocab), "--hidden-dropout", "0",
            "--attention-dropout", "0", "--pipeline-model-parallel-size", str(pp),
            "--pp-partition-method", "type:TransformerLayer", "--eval-iters", "0",
            "--virtual-pipeline-model-parallel-size", str(v)]


def _timed_run(cfg: TrainConfig, state: ParallelState, warmup: int) -> TimedEngine:
    """Build the trainer pretrain_gpt.py runs, its engine timed, and run it (``train_step``
    per iteration); the steps after ``warmup`` are kept."""
    trainer = build_trainer(cfg, state, torch.device("cpu"), overrides=Overrides(
        engine=TimedEngine.instrument,
        hooks=Hooks(on_step=lambda it, _: engine.end_step(keep=it > warmup))))
    engine = trainer.model.engine
    trainer.run()
    return engine


def _measure(a: argparse.Namespace,
             pp: int) -> tuple[str, list[str], dict[tuple[int, int], list[Trace]]]:
    """One stage: the machine, its layers (1F1B), and its traces of the timed steps for each
    (m, v)."""
    state, traces, layers = ParallelState.build(1, pp), {}, []
    for m in (pp, 4 * pp):
        for v in (1, *a.virtual):
            cfg = parse_args(_argv(a, pp, m, v))
            validate(cfg, pp)
            engine = _timed_run(cfg, state, a.warmup)
            traces[m, v] = engine.traces
            if v == 1:
                layers = [type(layer).__name__ for layer in engine.stage.layers]
    return devices.describe(torch.device("cpu")), layers, traces


def _duration(trace: Trace, kind: str) -> float:
    return sum(e - s for k, _, s, e, _ in trace["events"] if k == kind)


def _align(per_rank: list[list[Trace]]) -> list[list[Trace]]:
    """Put every rank's step on one origin: the first rank out of the barrier. The ranks share
    the host's monotonic clock (perf_counter), so a rank that left the barrier later has its
    times shifted by how much later; that lag is kept as "shift"."""
    aligned: list[list[Trace]] = [[] for _ in per_rank]
    for j in range(len(per_rank[0])):
        origin = min(rank[j]["t0"] for rank in per_rank)
        for r, rank in enumerate(per_rank):
            t, d = rank[j], rank[j]["t0"] - origin
            aligned[r].append({"shift": d, "fb_end": t["fb_end"] + d,
                               "step_end": t["step_end"] + d,
                               "events": [(k, mb, s + d, e + d, c)
                                          for k, mb, s, e, c in t["events"]]})
    return aligned


def _stats(per_rank: list[list[Trace]]) -> dict[str, Any]:
    """Median span and, per stage, median idle fraction and forward/backward times."""
    steps = range(len(per_rank[0]))
    spans = [max(rank[j]["fb_end"] for rank in per_rank) for j in steps]
    st: dict[str, Any] = {"idle": [], "fwd_mb": [], "bwd_mb": [], "ratio": [],
                          "cpu": []}
    for rank in per_rank:
        busy = [_duration(rank[j], "F") + _duration(rank[j], "B") for j in steps]
        st["idle"].append(statistics.median(1 - busy[j] / spans[j] for j in steps))
        fwd, bwd = (sum(_duration(t, kind) for t in rank) for kind in "FB")
        forwards = sum(1 for t in rank for kind, *_ in t["events"] if kind == "F")
        st["fwd_mb"].append(fwd / forwards)
        st["bwd_mb"].append(bwd / forwards)
        st["ratio"].append(bwd / fwd)
        cpu = sum(c for t in rank for *_, c in t["events"])
        st["cpu"].append(cpu / (fwd + bwd))
    st["span"] = statistics.median(spans)
    st["step"] = statistics.median(max(r[j]["step_end"] for r in per_rank) for j in steps)
    st["skew"] = max(t["shift"] for rank in per_rank for t in rank)
    st["median_step"] = sorted(steps, key=lambda j: spans[j])[len(spans) // 2]
    return st


def theory(p: int, m: int, v: int = 1) -> float:
    """(Interleaved) 1F1B idle fraction with backward = 2 x forward and free communication."""
    return (p - 1) / (v * m + p - 1)


def simulated(p: int, m: int, v: int = 1) -> list[float]:
    """Each stage's idle fraction under the schedule simulator (forward 1, backward 2)."""
    programs = [interleaved_1f1b(p, s, m, v) if v > 1 else schedule_for("1f1b", p, s, m)
                for s in range(p)]
    report = simulate(programs, chunks=v, forward_cost=1, backward_cost=2)
    return [stage.idle_time / report.makespan for stage in report.stages]


def _layers(names: list[str]) -> str:
    """A stage's layers in order, runs counted: 'emb,2 x block', '2 x block,norm,head'."""
    runs = [(SHORT.get(name, name), len(list(run))) for name, run in groupby(names)]
    return ",".join(name if n == 1 else f"{n} x {name}" for name, n in runs)


def _table(p: int, m: int, v: int, st: dict[str, Any], layers: list[list[str]]) -> list[str]:
    sim, th = simulated(p, m, v), theory(p, m, v)
    schedule = "1F1B" if v == 1 else f"interleaved, v={v}"
    lines = [f"PP={p} m={m} ({schedule}): pipeline span {st['span'] * 1e3:.1f} ms (median of the "
             f"timed steps), with grad sync + optimizer {st['step'] * 1e3:.1f} ms, ranks left the "
             f"barrier within {st['skew'] * 1e3:.2f} ms",
             f"  {'stage':>5}  {'layers':<22}{'idle meas.':>11}{'theory':>8}{'sim.':>7}"
             f"{'meas/theory':>12}{'fwd ms/mb':>11}{'bwd ms/mb':>11}{'bwd/fwd':>8}"
             f"{'cpu/wall':>9}"]
    for s in range(p):
        lines.append(f"  {s:>5}  {_layers(layers[s]):<22}{st['idle'][s]:>11.3f}"
                     f"{th:>8.3f}{sim[s]:>7.3f}{st['idle'][s] / th:>12.2f}"
                     f"{st['fwd_mb'][s] * 1e3:>11.2f}{st['bwd_mb'][s] * 1e3:>11.2f}"
                     f"{st['ratio'][s]:>8.2f}{st['cpu'][s]:>9.2f}")
    return lines


FORWARD = ((60, 100, 200), (110, 150, 235))  # alternate shades by micro-batch parity
BACKWARD = ((225, 120, 30), (245, 170, 90))
AFTER: Color = (160, 160, 160)  # grad sync + optimizer, after forward_backward
IDLE: Color = (235, 235, 235)
MARK: Color = (200, 0, 0)  # end of the pipeline span
ROW, GAP, MARGIN, AXIS = 40, 8, 10, 16


def _tick_ms(horizon_ms: float) -> float:
    """A 1-2-5 tick spacing giving about ten ticks over ``horizon_ms``."""
    step = 10.0 ** math.floor(math.log10(horizon_ms / 10))
    return next(k * step for k in (1, 2, 5, 10) if horizon_ms / (k * step) <= 12)


def draw(per_rank: list[Trace], width: int, path: Path) -> tuple[float, float]:
    """One step's timeline, scaled to ``width`` px; returns (px per ms, tick spacing ms)."""
    horizon_ms = max(t["step_end"] for t in per_rank) * 1e3
    px_per_ms = (width - 2 * MARGIN) / horizon_ms
    canvas = Canvas(width, 2 * MARGIN + len(per_rank) * (ROW + GAP) + AXIS)

    def x(seconds: float) -> int:
        return MARGIN + round(seconds * 1e3 * px_per_ms)

    for s, trace in enumerate(per_rank):
        y = MARGIN + s * (ROW + GAP)
        canvas.rect(x(0), y, x(trace["step_end"]), y + ROW, IDLE)
        canvas.rect(x(trace["fb_end"]), y, x(trace["step_end"]), y + ROW, AFTER)
        for kind, mb, start, end, _ in trace["events"]:
            shades = FORWARD if kind == "F" else BACKWARD
            canvas.rect(x(start), y, max(x(end), x(start) + 1), y + ROW, shades[mb % 2])
    bottom = MARGIN + len(per_rank) * (ROW + GAP)
    span_x = x(max(t["fb_end"] for t in per_rank))
    canvas.rect(span_x, MARGIN - 4, span_x + 1, bottom, MARK)
    tick = _tick_ms(horizon_ms)
    canvas.rect(x(0), bottom, x(horizon_ms / 1e3) + 1, bottom + 1, (0, 0, 0))
    for i in range(int(horizon_ms / tick) + 1):
        tx = x(i * tick / 1e3)
        canvas.rect(tx, bottom, tx + 1, bottom + (8 if i % 5 == 0 else 4), (0, 0, 0))
    canvas.save(path)
    return px_per_ms, tick


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--blocks-per-stage", type=int, default=2)
    p.add_argument("--virtual", type=int, nargs="*", default=[2],
                   help="chunks per stage of the interleaved runs (1F1B always runs)")
    add_model_args(p, layers=None, hidden=128, heads=4, seq=64, vocab=512)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5, help="timed steps per (PP, m)")
    p.add_argument("--width", type=int, default=1200, help="PNG width in pixels")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    return p.parse_args()


def _summary(out: Any, rows: list[tuple[int, int, int, float, float, float]]) -> None:
    """The table, and for each interleaved run: is its idle fraction within 0.05 of its
    theory plus the overhead 1F1B measured at the same (PP, m), and below 1F1B's?"""
    out.write(f"summary (mean over stages): {'PP':>3}{'m':>4}{'v':>3}{'idle meas.':>12}"
              f"{'theory':>8}{'sim.':>7}{'meas-theory':>13}{'bound':>7}{'ok':>4}"
              f"{'< 1F1B':>8}\n")
    plain = {(pp, m): (meas, th) for pp, m, v, meas, th, _ in rows if v == 1}
    for pp, m, v, meas, th, sim in rows:
        base_meas, base_th = plain[pp, m]
        bound = th + (base_meas - base_th) + 0.05
        checks = ("", "") if v == 1 else ("yes" if meas <= bound else "NO",
                                          "yes" if meas < base_meas else "NO")
        out.write(f"{'':>28}{pp:>3}{m:>4}{v:>3}{meas:>12.3f}{th:>8.3f}{sim:>7.3f}"
                  f"{meas - th:>13.3f}{bound if v > 1 else float('nan'):>7.3f}"
                  f"{checks[0]:>4}{checks[1]:>8}\n")


def main() -> None:
    a = _args()
    if not a.out.exists():  # a folder we make holds only results: keep them out of git
        a.out.mkdir(parents=True)
        (a.out / ".gitignore").write_text("*\n")
    out, start, summary = sys.stdout, time.perf_counter(), []
    out.write(f"model: GPT {a.blocks_per_stage} blocks per stage, hidden={a.hidden} "
              f"heads={a.heads} seq={a.seq} micro-batch={a.micro_batch} vocab={a.vocab} fp32, "
              f"dropout 0; {a.warmup} warm-up + {a.steps} timed train_steps per (PP, m)\n")
    for pp in a.pp:
        per_rank = spawn(_measure, pp, a, pp)
        if pp == a.pp[0]:
            out.write(f"machine (each stage, gloo on CPU, 1 thread): {per_rank[0][0]}; "
                      f"up to {max(a.pp)} processes share {os.cpu_count()} cores: the "
                      "timings are indicative only\n")
        for m in (pp, 4 * pp):
            for v in (1, *a.virtual):
                traces = _align([rank[2][m, v] for rank in per_rank])
                st = _stats(traces)
                out.write("\n".join(_table(pp, m, v, st, [rank[1] for rank in per_rank]))
                          + "\n")
                png = a.out / f"pipeline_bubble_pp{pp}_m{m}_v{v}.png"
                px, tick = draw([t[st["median_step"]] for t in traces], a.width, png)
                out.write(f"  timeline: {png} ({px:.1f} px/ms, ticks every {tick:g} ms)\n")
                summary.append((pp, m, v, statistics.mean(st["idle"]), theory(pp, m, v),
                                statistics.mean(simulated(pp, m, v))))
                out.flush()
    _summary(out, summary)
    out.write("timelines: rows = stages (stage 0 on top); blue = Forward, orange = Backward "
              "(two shades alternate by micro-batch), light grey = idle, dark grey = grad "
              "sync + optimizer after forward_backward, red line = end of the pipeline span\n"
              "note: with equal stages (p-1)/(m+p-1) holds whatever the backward/forward ratio; "
              "the measured idle time also holds the p2p exchanges, any stage imbalance (the "
              "last stage adds the final norm, LM head and loss) and time the OS gave the core "
              "to another process (cpu/wall < 1)\n"
              f"wall time: {time.perf_counter() - start:.1f} s\n")


if __name__ == "__main__":
    main()
