"""How long does a save hold training up: a blocking save against --async-save?

For each layout (1 rank; 2 ranks as DP=2 ZeRO-1) gloo processes (one thread each) run
``Trainer.run`` of the trainer ``pretrain_gpt.py`` builds three times, for the same steps: no
save (the baseline), a blocking save every ``--save-every`` steps, and ``--async-save``. A
step's time is the wall time between the ends of consecutive steps (``Trainer.on_step``), so
the step after a save's iteration carries what the save blocked (a blocking save: all of
it; an asynchronous one: waiting for the save before, the checks and the copy to host
memory), and the steps after that carry the background writer's share of the cores. Per
save (median over the saves, slowest rank):

- save call: the time inside ``trainer.save``, the part that blocks training;
- saving step: the step that includes the save, / the baseline's median step;
- stall: the saving step and the ``--after`` steps after it together, less as many median
  steps of the baseline: what the save cost training in all;
- write: how long the background thread took to write the rank file (async only).

The baseline run stops at a far ``--exit-interval``, so that it makes the same per-step exit
agreement (one all-reduce) as a run with ``--save``; no run evaluates. Checkpoints go to
``--dir`` (default a temporary directory on the disk of /tmp) and include fsync. Ranks share
the machine's cores with the writer threads, so on a CPU machine the background write
competes with training for the same cores; with GPUs it competes only for host cores.

    python -m benchmarks.checkpoint_save
    python -m benchmarks.checkpoint_save --hidden 768 --saves 5 --dir /fast/scratch
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import add_model_args, spawn
from megatron3d import device as devices
from megatron3d.checkpoint import io
from megatron3d.checkpoint.progress import Progress
from megatron3d.cli.arguments import parse_args
from megatron3d.mpu.state import ParallelState
from megatron3d.training.build import Overrides, build_trainer
from megatron3d.training.loop import Hooks
from megatron3d.validation import validate

MODES = ("no save", "blocking", "async")
LAYOUTS = {"1 rank": 1, "DP=2 ZeRO-1": 2}  # name -> world size
MIB = 1024 * 1024


def _argv(a: argparse.Namespace, world: int, mode: str, directory: str) -> list[str]:
    saving = ["--save", directory, "--save-interval", str(a.save_every)]
    return ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden),
            "--num-attention-heads", str(a.heads), "--seq-length", str(a.seq),
            "--micro-batch-size", str(a.micro_batch),
            "--global-batch-size", str(a.micro_batch * world * 2),
            "--train-iters", str(a.save_every * a.saves + a.after + 1), "--lr", "1e-4",
            "--lr-decay-style", "constant", "--mock-data", "--vocab-size", str(a.vocab),
            "--zero-stage", "1", "--eval-iters", "0", "--log-interval", "1000",
            *({"no save": ["--exit-interval", "1000000"], "blocking": saving,
               "async": [*saving, "--async-save"]}[mode])]


class _TimedSaver:
    """The trainer's saver, timed per call (the part of a save that blocks training)."""

    def __init__(self, saver: Any) -> None:
        self.saver, self.calls = saver, []

    def __call__(self, progress: Progress) -> str:
        start = time.perf_counter()
        directory = self.saver(progress)
        self.calls.append(time.perf_counter() - start)
        return directory

    def wait(self) -> None:
        self.saver.wait()


def _run(a: argparse.Namespace, world: int, mode: str, root: str) -> dict[str, Any]:
    """One rank of one run: the end time of each step, the save calls and the writes."""
    cfg = parse_args(_argv(a, world, mode, f"{root}/{mode}"))
    validate(cfg, world)
    ends: dict[int, float] = {}
    timed: list[_TimedSaver] = []

    def timed_saver(saver: Any) -> _TimedSaver | None:
        timed.extend([] if saver is None else [_TimedSaver(saver)])
        return timed[0] if timed else None

    trainer = build_trainer(cfg, ParallelState.build(1, 1), torch.device("cpu"),
                            overrides=Overrides(save=timed_saver, hooks=Hooks(
                                on_step=lambda it, _: ends.__setitem__(it, time.perf_counter()))))
    real, writes, sizes = io.write_rank, [], []

    def timed_write(directory: Path, rank: int, payload: dict[str, Any]) -> None:
        start = time.perf_counter()
        real(directory, rank, payload)
        writes.append(time.perf_counter() - start)
        sizes.append(io.rank_file(directory, rank).stat().st_size)

    io.write_rank = timed_write
    try:
        trainer.run()
    finally:
        io.write_rank = real
    return {"ends": ends, "calls": timed[0].calls if timed else [], "writes": writes,
            "bytes": sizes, "machine": devices.describe(torch.device("cpu"))}


def _steps(ranks: list[dict], first: int, count: int) -> float:
    """Seconds of steps first..first+count-1 together, on the slowest rank."""
    return max(r["ends"][first + count - 1] - r["ends"][first - 1] for r in ranks)


def _summary(a: argparse.Namespace, runs: dict[str, list[list[dict]]]) -> dict[str, dict]:
    """Medians over every save of every repeat, against the baseline's median step (a
    median: one step slowed by another job on the machine does not move it)."""
    saves = [a.save_every * (i + 1) for i in range(a.saves)]
    step = statistics.median(_steps(base, i, 1) for base in runs["no save"]
                             for i in range(2, max(base[0]["ends"]) + 1))
    out = {"step": {"median": step}}
    for mode in ("blocking", "async"):
        ranks_of = runs[mode]
        out[mode] = {
            "call": statistics.median(max(r["calls"][i] for r in ranks)
                                      for ranks in ranks_of for i in range(a.saves)),
            "saving": statistics.median(_steps(ranks, k + 1, 1) / step
                                        for ranks in ranks_of for k in saves),
            "stall": statistics.median(_steps(ranks, k + 1, a.after + 1) - (a.after + 1) * step
                                       for ranks in ranks_of for k in saves),
            "write": statistics.median(max(r["writes"][i] for r in ranks)
                                       for ranks in ranks_of for i in range(a.saves)),
            "bytes": max(r["bytes"][0] for r in ranks_of[0])}
    return out


def _table(name: str, s: dict[str, dict]) -> list[str]:
    step, block, asy = s["step"]["median"], s["blocking"], s["async"]
    lines = [f"{name}: median step without saving {step * 1000:.0f} ms; rank file "
             f"{block['bytes'] / MIB:.1f} MiB",
             f"  {'save':<9} {'save call':>10} {'/ step':>7} {'saving step / step':>19} "
             f"{'stall':>9} {'/ step':>7} {'write':>9}"]
    for mode, r in (("blocking", block), ("async", asy)):
        write = f"{r['write'] * 1000:>6.0f} ms" if mode == "async" else f"{'':>9}"
        lines.append(f"  {mode:<9} {r['call'] * 1000:>7.0f} ms {r['call'] / step:>7.2f} "
                     f"{r['saving']:>19.2f} {r['stall'] * 1000:>6.0f} ms "
                     f"{r['stall'] / step:>7.2f} {write}")
    lines.append(f"  async / blocking: save call {asy['call'] / block['call']:.3f}, stall "
                 f"{asy['stall'] / block['stall']:.3f}")
    return lines


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p, hidden=512)
    p.add_argument("--saves", type=int, default=3, help="saves per run (default 3)")
    p.add_argument("--save-every", type=int, default=6, help="steps between saves")
    p.add_argument("--after", type=int, default=4,
                   help="steps after the saving step counted in the stall (default 4)")
    p.add_argument("--repeats", type=int, default=2, help="runs of each mode (default 2)")
    p.add_argument("--dir", default=None, help="where to write the checkpoints")
    return p.parse_args()


def main() -> None:
    a = _args()
    out, start = sys.stdout, time.perf_counter()
    out.write(f"model: GPT layers={a.layers} hidden={a.hidden} heads={a.heads} seq={a.seq} "
              f"vocab={a.vocab}, 2 micro-batches of {a.micro_batch} per rank a step, fp32; "
              f"a save every {a.save_every} steps, {a.saves} saves a run, {a.repeats} runs "
              "of each mode\n")
    for name, world in LAYOUTS.items():
        runs: dict[str, list[list[dict]]] = {mode: [] for mode in MODES}
        for repeat in range(a.repeats):  # the order alternates, so that drift cancels
            for mode in MODES if repeat % 2 == 0 else MODES[::-1]:
                with tempfile.TemporaryDirectory(prefix="m3d_save_bench_", dir=a.dir) as root:
                    runs[mode].append(spawn(_run, world, a, world, mode, root,
                                            timeout_s=900.0))
        if world == 1:
            out.write(f"machine: {runs['no save'][0][0]['machine']}; {os.cpu_count()} cores "
                      "shared by the ranks and their writer threads; load average "
                      f"{os.getloadavg()[0]:.1f}\n")
        out.write("\n".join(_table(name, _summary(a, runs))) + "\n")
        out.flush()
    out.write(f"wall time: {time.perf_counter() - start:.1f} s\n")


if __name__ == "__main__":
    main()
