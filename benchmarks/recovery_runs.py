"""Kill-and-recover runs under ``torchrun --max-restarts``, as a user launches them, and what
they are judged by: the job ends by itself, few steps run twice, the kill costs little time,
and the model is bitwise the one an uninterrupted run trains.

A run is 8 workers of ``benchmarks/recovery_worker.py`` (``pretrain_gpt.main`` that writes
its pid and each step's loss at full precision) at (tp 2, pp 2, dp 2), with local
checkpoints in memory at every step and global ones every ``save_interval`` steps. A
``Kill`` waits until a rank of the current attempt finished a step, waits a moment more (so
the kill lands inside the next step), and SIGKILLs its ranks; with ``lose_store`` it first
freezes them (SIGSTOP) and deletes their store directories, as if their host's memory went
with them. The judging reads the files the workers wrote, torchrun's output (the log line
of each iteration, ``restart k of K``, ``notice:``) and the final global checkpoint's rank
files, compared tensor by tensor. Shared by ``benchmarks/recovery.py`` and the end-to-end
test (``tests/training/test_in_job_restart.py``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
WORLD = 8
SHAPES = {  # name -> flags on top of (tp 2, pp 2, dp 2)
    "ZeRO-1": ["--zero-stage", "1"],
    "ZeRO-3": ["--zero-stage", "3"],
    "ZeRO-1, interleaved": ["--zero-stage", "1", "--num-layers-per-virtual-pipeline-stage",
                            "1"],
}
ITERATION = re.compile(r"^ iteration +(\d+)/", re.MULTILINE)
RESTART = re.compile(r"^restart (\d+) of \d+ ", re.MULTILINE)
LOST = "notice: the local checkpoint at iteration"
# Saved, but drawn from by no training code and seeded by none: the process-wide Python and
# NumPy generators start from the OS's entropy, so two uninterrupted runs differ there too.
UNSEEDED = ("/rng/python/", "/rng/numpy/")


def argv(work: Path, shape: str, iters: int, save_interval: int) -> list[str]:
    """The tiny (2,2,2) run with local saves every step and global ones every
    ``save_interval`` steps (and at the end), resuming from either."""
    return ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "8",
            "--train-iters", str(iters), "--lr", "3e-3", "--min-lr", "3e-4",
            "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--mock-data",
            "--vocab-size", "203", "--make-vocab-size-divisible-by", "8",
            "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--log-interval", "1",
            "--eval-iters", "0", "--tensor-model-parallel-size", "2",
            "--pipeline-model-parallel-size", "2", *SHAPES[shape],
            "--save", str(work / "ckpt"), "--load", str(work / "ckpt"),
            "--save-interval", str(save_interval), "--non-persistent-save-interval", "1",
            "--non-persistent-ckpt-type", "memory",
            "--non-persistent-local-ckpt-dir", str(work / "local")]


class Job:
    """One ``torchrun --standalone --max-restarts K`` of the worker; output in out.log."""

    def __init__(self, work: Path, args: list[str], max_restarts: int) -> None:
        work.mkdir(parents=True, exist_ok=True)
        self.work = work
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": str(ROOT), "RECOVERY_DIR": str(work)}
        for name in ("MEGATRON3D_EXIT_DIR", "TORCHELASTIC_RUN_ID"):
            env.pop(name, None)
        with open(work / "out.log", "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--standalone",
                 "--nproc-per-node", str(WORLD), "--max-restarts", str(max_restarts),
                 "--monitor-interval", "0.1", "--module", "benchmarks.recovery_worker",
                 *args], cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT)

    def records(self) -> list[dict[str, Any]]:
        found = []
        for path in sorted(self.work.glob("steps-*.jsonl")):
            rank = int(path.stem.split("-")[1])
            found += [{**json.loads(line), "rank": rank}
                      for line in path.read_text().splitlines() if line.endswith("}")]
        return found

    def wait_for_step(self, attempt: int, rank: int, at_least: int, timeout_s: float) -> None:
        """Until ``rank`` of ``attempt`` finished iteration ``at_least`` or a later one."""
        deadline = time.monotonic() + timeout_s
        while not any(r["attempt"] == attempt and r["rank"] == rank
                      and r["iteration"] >= at_least for r in self.records()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"attempt {attempt} never reached iteration {at_least} on "
                                   f"rank {rank}:\n{self.log()[-3000:]}")
            time.sleep(0.05)

    def pid(self, attempt: int, rank: int) -> int:
        return int((self.work / f"pid-{attempt}-{rank}").read_text())

    def finish(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return -9

    def log(self) -> str:
        return (self.work / "out.log").read_text(errors="replace")


@dataclass(frozen=True)
class Kill:
    """SIGKILL ``ranks`` of the current attempt ``delay_s`` after ``ranks[0]`` finished
    iteration ``after``; ``lose_store``: freeze them and delete their store directories
    first (their host's memory lost with them)."""

    ranks: tuple[int, ...]
    after: int
    delay_s: float
    lose_store: bool = False

    def apply(self, job: Job, attempt: int, timeout_s: float) -> float:
        """Do it; the wall time of the kill."""
        job.wait_for_step(attempt, self.ranks[0], self.after, timeout_s)
        time.sleep(self.delay_s)
        pids = [job.pid(attempt, r) for r in self.ranks]
        if self.lose_store:
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            for rank in self.ranks:
                for directory in (job.work / "local").glob(f"megatron3d-*/rank{rank}"):
                    shutil.rmtree(directory)
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        return time.time()


@dataclass
class Outcome:
    """What a run shows; one entry per kill in ``kill_to_step_s`` and ``re_executed``."""

    code: int
    kill_to_step_s: list[float]  # kill -> every rank of the next attempt finished a step
    re_executed: list[int]  # steps logged again after each restart
    losses: dict[int, str]  # iteration -> the last stage's loss, at full precision
    unstable: list[int]  # iterations whose loss differs between the attempts that ran them
    lost_notices: list[str]
    log: str


def run(work: Path, shape: str, iters: int, save_interval: int, kills: list[Kill],
        timeout_s: float = 300.0) -> Outcome:
    """One job of the worker; ``kills[k]`` is applied to attempt ``k``."""
    job = Job(work, argv(work, shape, iters, save_interval), max_restarts=max(len(kills), 1))
    deadline = time.monotonic() + timeout_s
    killed_at = [kill.apply(job, attempt, deadline - time.monotonic())
                 for attempt, kill in enumerate(kills)]
    code = job.finish(max(deadline - time.monotonic(), 1.0))
    records, log = job.records(), job.log()
    return Outcome(code, [_kill_to_step(records, attempt + 1, at)
                          for attempt, at in enumerate(killed_at)],
                   re_executed(log), _losses(records), _unstable(records),
                   [line for line in log.splitlines() if line.startswith(LOST)], log)


def _kill_to_step(records: list[dict[str, Any]], attempt: int, killed_at: float) -> float:
    """Seconds from the kill until every rank of ``attempt`` finished its first step."""
    firsts: dict[int, float] = {}
    for r in records:
        if r["attempt"] == attempt:
            firsts[r["rank"]] = min(firsts.get(r["rank"], r["time"]), r["time"])
    if len(firsts) < WORLD:
        return float("inf")
    return max(firsts.values()) - killed_at


def re_executed(log: str) -> list[int]:
    """For each ``restart k of K`` line of the log, how many of the iterations logged after
    it had been logged before it: the steps that restart ran twice."""
    bounds = [m.start() for m in RESTART.finditer(log)]
    segments = [log[a:b] for a, b in zip([0, *bounds], [*bounds, len(log)], strict=True)]
    seen: set[int] = set()
    counts = []
    for k, segment in enumerate(segments):
        logged = {int(i) for i in ITERATION.findall(segment)}
        if k:
            counts.append(len(logged & seen))
        seen |= logged
    return counts


def _losses(records: list[dict[str, Any]]) -> dict[int, str]:
    ordered = sorted((r for r in records if r["loss"] is not None),
                     key=lambda r: (r["attempt"], r["iteration"]))
    return {r["iteration"]: r["loss"] for r in ordered}


def _unstable(records: list[dict[str, Any]]) -> list[int]:
    seen: dict[int, set[str]] = {}
    for r in records:
        if r["loss"] is not None:
            seen.setdefault(r["iteration"], set()).add(r["loss"])
    return sorted(i for i, values in seen.items() if len(values) > 1)


def checkpoint_differences(a: Path, b: Path) -> list[str]:
    """Where the newest checkpoints in ``a`` and ``b`` differ: each rank file compared entry
    by entry (all but ``UNSEEDED``), tensors with ``torch.equal`` (bitwise, dtypes
    included). Empty: the same."""
    dirs = [root / f"iter_{int((root / 'latest').read_text()):07d}" for root in (a, b)]
    names = [sorted(p.name for p in d.glob("rank_*.pt")) for d in dirs]
    if names[0] != names[1] or not names[0]:
        return [f"rank files differ: {names[0]} vs {names[1]}"]
    found = []
    for name in names[0]:
        left, right = (_leaves(torch.load(d / name, weights_only=True)) for d in dirs)
        if left.keys() != right.keys():
            found.append(f"{name}: entries differ")
            continue
        found += [f"{name}{key}" for key, value in left.items()
                  if not key.startswith(UNSEEDED) and not _same(value, right[key])]
    return found


def _leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _leaves(sub, f"{prefix}/{key}")
                .items()}
    if isinstance(tree, list | tuple):
        return {k: v for i, sub in enumerate(tree) for k, v in _leaves(sub, f"{prefix}/{i}")
                .items()}
    return {prefix: tree}


def _same(x: Any, y: Any) -> bool:
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
    return x == y
