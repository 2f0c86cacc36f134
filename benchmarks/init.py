"""How do a rank's initialisation time and memory change with TP, drawing the initial weights
and skipping the draw under ``--load``?

For each TP size in ``--tp`` (default 1 2 4), that many gloo processes (one thread each)
build the trainer ``pretrain_gpt.py`` builds for a vocabulary-heavy model (default vocab
262,144 x hidden 512, 4 layers, tied embeddings, fp32), everything up to the first step:

- draw: a run from the seed. Each rank draws its slices of every weight.
- load: the same run with ``--load`` of a checkpoint of that model (saved by the TP=1 draw
  run, so TP > 1 reshards it): the model is built without drawing and the checkpoint fills
  it. The load itself (``megatron3d.checkpoint.loading.load``) is shown apart, since its cost
  belongs to the checkpoint reader, not to initialisation.

Per rank, the slowest shown:
- model s / model cpu s: wall and CPU time of making the model's storage (the layers are
  built on the meta device; ``build_data_parallel`` allocates the ZeRO buffers and draws the
  weights into them, or under --load only allocates them). TP ranks share the machine's
  cores, so at TP > cores wall time inflates and CPU time is the fair per-rank measure.
- model peak: the peak resident set size (RSS) above the RSS when ``build_trainer`` starts,
  up to the end of building the model.
- peak: the same up to the first step (draw) or up to the start of the checkpoint load
  (load): it includes binding the parameters to the data-parallel buffers and the optimizer.
The kernel's high-water mark (``VmHWM``) is reset through ``/proc/self/clear_refs`` first;
without it the lifetime peak from ``resource.getrusage`` is used and the header says so.
Ratios are to TP=1 of the same mode, measured in the same invocation.

    python -m benchmarks.init
    python -m benchmarks.init --vocab 50304 --hidden 1024 --layers 8
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import add_model_args, spawn
from megatron3d import device as devices
from megatron3d.checkpoint import loading
from megatron3d.cli.arguments import parse_args
from megatron3d.mpu.state import ParallelState
from megatron3d.training import build
from megatron3d.validation import validate

MIB = 1024 * 1024
MODES = ("draw", "load")


class Peak:
    """Peak memory above the memory in use at ``start()`` (``device.reset_peak_memory``:
    exact where Linux lets the kernel's peak be reset)."""

    def __init__(self) -> None:
        self.exact = Path("/proc/self/clear_refs").exists()
        self.cpu = torch.device("cpu")

    def start(self) -> None:
        gc.collect()
        self.base = devices.reset_peak_memory(self.cpu)

    def growth(self) -> int:
        return max(0, devices.peak_memory(self.cpu) - self.base)


@dataclass(frozen=True)
class Measured:
    """One rank, one mode."""

    params: int  # parameters on this rank
    model_s: float
    model_cpu_s: float
    model_peak: int  # bytes above the start of build_trainer, up to the model's end
    peak: int  # bytes above the start of build_trainer, up to the first step or the load
    load_s: float  # 0 without --load
    load_peak: int  # the whole build's peak with --load (the load included), else 0


def _argv(a: argparse.Namespace, tp: int, directory: str, mode: str) -> list[str]:
    argv = ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden),
            "--num-attention-heads", str(a.heads), "--seq-length", str(a.seq),
            "--micro-batch-size", str(a.micro_batch), "--global-batch-size",
            str(a.micro_batch), "--train-iters", "1", "--lr", "1e-4", "--lr-decay-style",
            "constant", "--mock-data", "--vocab-size", str(a.vocab),
            "--tensor-model-parallel-size", str(tp), "--save", directory]
    return [*argv, "--load", directory] if mode == "load" else argv


def _timed(fn: Any, into: dict[str, float], key: str, peak: Peak) -> Any:
    """``fn`` recording its wall and CPU time, and the peak so far at its start and end."""
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        into[f"{key}_peak_before"] = peak.growth()
        wall, cpu = time.perf_counter(), time.process_time()
        result = fn(*args, **kwargs)
        into[key], into[f"{key}_cpu"] = time.perf_counter() - wall, time.process_time() - cpu
        into[f"{key}_peak_after"] = peak.growth()
        return result
    return wrapper


def _measure(a: argparse.Namespace, tp: int, mode: str, directory: str) -> tuple[str, bool,
                                                                                Measured]:
    """One rank: build the trainer, timing the model and the load; the TP=1 draw run saves
    the checkpoint the load runs read."""
    state = ParallelState.build(tp, 1)
    cfg = parse_args(_argv(a, tp, directory, mode))
    validate(cfg, state.world_size)
    peak, timed = Peak(), {}
    original_engine, original_load = build.build_data_parallel, loading.load
    build.build_data_parallel = _timed(original_engine, timed, "model", peak)
    loading.load = _timed(original_load, timed, "load", peak)
    try:
        peak.start()
        trainer = build.build_trainer(cfg, state, torch.device("cpu"))
        whole = peak.growth()
    finally:
        build.build_data_parallel, loading.load = original_engine, original_load
    if mode == "load" and "load" not in timed:
        raise RuntimeError(f"build_trainer did not load a checkpoint from {directory}")
    if mode == "draw" and tp == 1:
        trainer.save(trainer.progress)
    params = sum(p.numel() for p in trainer.model.engine.stage.parameters())
    measured = Measured(params, timed["model"], timed["model_cpu"],
                        int(timed["model_peak_after"]), int(timed.get("load_peak_before", whole)),
                        timed.get("load", 0.0), whole if mode == "load" else 0)
    return devices.describe(torch.device("cpu")), peak.exact, measured


def _ratio(x: float, base: float) -> str:
    return f"{x / base:.2f}" if base > 0 else "-"


def _worst(ranks: list[Measured]) -> tuple[float, float, int, int]:
    """The slowest or largest rank's model s, model cpu s, model peak and peak."""
    return (max(r.model_s for r in ranks), max(r.model_cpu_s for r in ranks),
            max(r.model_peak for r in ranks), max(r.peak for r in ranks))


def _table(mode: str, rows: dict[int, list[Measured]]) -> list[str]:
    base = _worst(rows[min(rows)])
    lines = [f"{mode}:", f"  {'TP':>3} {'params/rank':>12} {'model s':>8} {'model cpu s':>12} "
             f"{'model peak':>10} {'peak':>8} | {'ratio: model s':>14} {'cpu s':>6} "
             f"{'model peak':>10} {'peak':>6}"
             + (f" | {'load s':>7} {'peak with load':>14}" if mode == "load" else "")]
    for tp, ranks in rows.items():
        model_s, cpu_s, model_peak, peak = worst = _worst(ranks)
        ratios = [_ratio(x, b) for x, b in zip(worst, base, strict=True)]
        line = (f"  {tp:>3} {max(r.params for r in ranks):>12,} {model_s:>8.3f} {cpu_s:>12.3f} "
                f"{model_peak / MIB:>6.0f} MiB {peak / MIB:>4.0f} MiB | {ratios[0]:>14} "
                f"{ratios[1]:>6} {ratios[2]:>10} {ratios[3]:>6}")
        if mode == "load":
            line += (f" | {max(r.load_s for r in ranks):>7.3f} "
                     f"{max(r.load_peak for r in ranks) / MIB:>10.0f} MiB")
        lines.append(line)
    return lines


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p, layers=4, hidden=512, heads=8, seq=128, micro_batch=1, vocab=262144)
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--dir", default=None,
                   help="where to write the checkpoint (default: a temporary directory)")
    return p.parse_args()


def main() -> None:
    a = _args()
    out, start = sys.stdout, time.perf_counter()
    out.write(f"model: GPT layers={a.layers} hidden={a.hidden} heads={a.heads} seq={a.seq} "
              f"vocab={a.vocab}, tied embeddings, fp32\n")
    with tempfile.TemporaryDirectory(prefix="m3d_init_bench_", dir=a.dir) as root:
        directory = str(Path(root) / "ckpt")
        for mode in MODES:
            rows = {}
            for tp in sorted(a.tp):
                replies = spawn(_measure, tp, a, tp, mode, directory, timeout_s=900.0)
                if mode == MODES[0] and tp == min(a.tp):
                    out.write(f"machine (each rank, gloo on CPU): {replies[0][0]}; "
                              f"{os.cpu_count()} cores shared by up to {max(a.tp)} ranks\n")
                    out.write("memory: " + ("peak RSS above build_trainer's start (VmHWM reset "
                                            "via /proc/self/clear_refs)" if replies[0][1] else
                                            "lifetime peak RSS from getrusage") + "\n")
                rows[tp] = [m for _, _, m in replies]
            out.write("\n".join(_table(mode, rows)) + "\n")
            out.flush()
    out.write(f"wall time: {time.perf_counter() - start:.1f} s\n")


if __name__ == "__main__":
    main()
