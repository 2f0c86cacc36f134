"""How long do saving and loading take, and how much memory do they need, against size and
layout?

For each layout (1 rank; 4 ranks as DP=4 ZeRO-1; 4 ranks as TP=2 x DP=2 ZeRO-0) gloo
processes (one thread each) build the trainer ``pretrain_gpt.py`` builds, for each model size
in ``--hidden``:

- save: ``trainer.save(trainer.progress)``, the call ``Trainer.run`` makes (every rank writes
  its own chunks, fsyncs, rank 0 writes meta.json and publishes). Timed on every rank from a
  barrier to the return (the save ends with a barrier, so this is the slowest rank's time).
- load: a fresh trainer built with ``--load`` on the checkpoint just written, as a resumed run
  does. ``checkpoint.load`` inside the build is timed on its own (a wrapper around
  ``megatron3d.checkpoint.loading.load``, which ``build_trainer`` calls); the whole build
  (model init + load) is shown next to it.
- load into another layout: the largest size trained one step at (TP, PP, DP) = (2, 2, 2)
  ZeRO-1, saved with its chunk index and loaded into the same layout, then with one of TP,
  PP, DP or the ZeRO stage changed, and into (4, 1, 2): ``checkpoint.load``'s time (slowest
  rank, and as a ratio to the same-layout load), each rank's peak memory as a multiple of its
  own shard (fp32 weights and both Adam moments, worst rank) and the rank files each opened.

Memory: the peak resident set size (RSS) of each process during the call, above its RSS when
the call starts, once the C heap gave its free memory back (``malloc_trim``: memory freed
earlier and reused would hide growth). The kernel's high-water mark (``VmHWM``) is reset through
``/proc/self/clear_refs`` right before the call and read right after, so it covers every
allocation (torch's tensor storage, pickling buffers, file pages mapped by ``torch.load``'s
mmap), not only Python's allocator as tracemalloc would. Without a writable ``clear_refs``
(not Linux) the lifetime peak from ``resource.getrusage`` is used and the header says so.

Above, no training step is taken: the Adam moments are zeros, which takes the same bytes on
disk and the same time to save (torch.save does not compress), and a load skips them. The
checkpoint is read back right after it was written, so the load reads from the page cache,
not the disk; the save includes fsync. Up to eight ranks on a machine with fewer cores share
them, so time ratios between rank counts are indicative only; the sizes do not depend on the
machine.

    python -m benchmarks.checkpoint
    python -m benchmarks.checkpoint --hidden 256 1024 --layers 8 --dir /fast/scratch
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import re
import resource
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.common import spawn
from megatron3d import device as devices
from megatron3d.checkpoint import loading
from megatron3d.cli.arguments import parse_args
from megatron3d.mpu.state import ParallelState
from megatron3d.training.build import build_trainer
from megatron3d.training.loop import Trainer
from megatron3d.validation import validate

MIB = 1024 * 1024
_LIBC = ctypes.CDLL(None)


@dataclass(frozen=True)
class Layout:
    name: str
    tp: int
    dp: int
    zero_stage: int
    pp: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp


LAYOUTS = [Layout("1 rank", 1, 1, 0), Layout("DP=4 ZeRO-1", 1, 4, 1),
           Layout("TP=2 x DP=2 ZeRO-0", 2, 2, 0)]
# A checkpoint saved at (TP, PP, DP) = (2, 2, 2) with ZeRO-1, loaded into each of these.
SAVED = Layout("same layout", 2, 2, 1, pp=2)
CHANGES = [SAVED, Layout("TP 2 -> 1", 1, 2, 1, pp=2), Layout("PP 2 -> 1", 2, 2, 1),
           Layout("DP 2 -> 1", 2, 1, 1, pp=2), Layout("ZeRO 1 -> 3", 2, 2, 3, pp=2),
           Layout("ZeRO 1 -> 0", 2, 2, 0, pp=2), Layout("(4, 1, 2)", 4, 2, 1)]


@dataclass(frozen=True)
class Measured:
    """One rank, one model size."""

    params: int  # parameters on this rank (TP slices counted once per rank)
    file_bytes: int  # this rank's rank_XXXXX.pt
    dir_bytes: int  # the whole iter_ directory (rank 0 only, else 0)
    save_s: float
    save_peak: int  # bytes of RSS above the start of the call
    load_s: float  # checkpoint.load alone
    build_load_s: float  # build_trainer with --load (model init + load)
    load_peak: int


# --- memory ----------------------------------------------------------------------------------

def _status_kib(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M)[1])


def _can_reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        _status_kib("VmHWM")
        return True
    except (OSError, TypeError):
        return False


class PeakRSS:
    """Peak RSS above the RSS at ``__enter__`` (bytes); exact where the peak can be reset."""

    def __init__(self) -> None:
        self.exact = _can_reset_peak()
        self.peak = 0

    def _rss(self) -> int:
        if self.exact:
            return _status_kib("VmRSS") * 1024
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def __enter__(self) -> PeakRSS:
        gc.collect()
        getattr(_LIBC, "malloc_trim", lambda _: 0)(0)  # free heap reused would hide growth
        if self.exact:
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        self.start = self._rss()
        return self

    def __exit__(self, *exc: object) -> None:
        high = (_status_kib("VmHWM") * 1024 if self.exact
                else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        self.peak = max(0, high - self.start)


# --- one rank --------------------------------------------------------------------------------

def _argv(a: argparse.Namespace, hidden: int, layout: Layout, directory: Path) -> list[str]:
    return ["--num-layers", str(a.layers), "--hidden-size", str(hidden),
            "--num-attention-heads", str(a.heads), "--seq-length", str(a.seq),
            "--micro-batch-size", str(a.micro_batch),  # one batch for every DP size
            "--global-batch-size", str(a.micro_batch * 4), "--train-iters", "1",
            "--lr", "1e-4", "--lr-decay-style", "constant", "--mock-data",
            "--vocab-size", str(a.vocab), "--hidden-dropout", "0", "--attention-dropout", "0",
            "--tensor-model-parallel-size", str(layout.tp),
            "--pipeline-model-parallel-size", str(layout.pp), "--pp-partition-method",
            "uniform", "--zero-stage", str(layout.zero_stage), "--save", str(directory)]


def _build(argv: list[str], state: ParallelState) -> tuple[Trainer, float]:
    cfg = parse_args(argv)
    validate(cfg, state.world_size)
    start = time.perf_counter()
    trainer = build_trainer(cfg, state, torch.device("cpu"))
    return trainer, time.perf_counter() - start


def _one_size(a: argparse.Namespace, hidden: int, layout: Layout, state: ParallelState,
              root: Path) -> Measured:
    directory = root / f"hidden_{hidden}"
    argv = _argv(a, hidden, layout, directory)
    trainer, _ = _build(argv, state)
    params = sum(p.numel() for p in trainer.model.engine.stage.parameters())
    dist.barrier()
    with PeakRSS() as save_mem:
        start = time.perf_counter()
        trainer.save(trainer.progress)
        save_s = time.perf_counter() - start
    saved = directory / f"iter_{trainer.progress.iteration:07d}"
    file_bytes = (saved / f"rank_{state.world_rank:05d}.pt").stat().st_size
    dir_bytes = (sum(f.stat().st_size for f in saved.iterdir())
                 if state.world_rank == 0 else 0)
    del trainer
    gc.collect()
    dist.barrier()

    trainer, build_load_s, load_s, load_peak, _ = _load(argv, directory, state)
    del trainer
    gc.collect()
    dist.barrier()
    if state.world_rank == 0:
        shutil.rmtree(directory)
    dist.barrier()
    return Measured(params, file_bytes, dir_bytes, save_s, save_mem.peak, load_s,
                    build_load_s, load_peak)


def _load(argv: list[str], directory: Path,
          state: ParallelState) -> tuple[Trainer, float, float, int, int]:
    """A trainer built with ``--load directory``, as a resumed run does: it, the build's and
    ``checkpoint.load``'s seconds, the load's peak memory and the rank files it opened."""
    timed: dict[str, float] = {}
    load_mem, opened = PeakRSS(), []
    original_load, original_read = loading.load, torch.load

    def timed_load(*args, **kwargs):
        with load_mem:
            begin = time.perf_counter()
            progress = original_load(*args, **kwargs)
            timed["load"] = time.perf_counter() - begin
        return progress

    def counted_read(f, *args, **kwargs):
        opened.append(f)
        return original_read(f, *args, **kwargs)

    loading.load, torch.load = timed_load, counted_read
    try:
        trainer, build_load_s = _build([*argv, "--load", str(directory)], state)
    finally:
        loading.load, torch.load = original_load, original_read
    if "load" not in timed:
        raise RuntimeError(f"build_trainer did not call checkpoint.load on {directory}")
    return trainer, build_load_s, timed["load"], load_mem.peak, len(opened)


def _measure(a: argparse.Namespace, layout: Layout, root: str) -> tuple[str, bool, list]:
    """One rank of ``layout``: every size in turn."""
    state = ParallelState.build(layout.tp, layout.pp)
    exact = PeakRSS().exact
    results = [_one_size(a, hidden, layout, state, Path(root)) for hidden in a.hidden]
    return devices.describe(torch.device("cpu")), exact, results


def _save_for_changes(a: argparse.Namespace, directory: str) -> None:
    """One rank of ``SAVED``: the largest size trained one step (so that the Adam moments
    are loaded too) and saved (with its chunk index)."""
    state = ParallelState.build(SAVED.tp, SAVED.pp)
    trainer, _ = _build([*_argv(a, a.hidden[-1], SAVED, Path(directory)), "--eval-iters", "0"],
                        state)
    trainer.run()


def _load_changed(a: argparse.Namespace, layout: Layout,
                  directory: str) -> tuple[float, int, int, int]:
    """One rank of ``layout`` loading that checkpoint: seconds, peak bytes, the bytes of its
    own shard (fp32 weights and both Adam moments) and the rank files it opened."""
    state = ParallelState.build(layout.tp, layout.pp)
    argv = _argv(a, a.hidden[-1], layout, Path(directory))
    trainer, _, load_s, peak, opened = _load(argv, Path(directory), state)
    return load_s, peak, 12 * trainer.model.optimizer.shard.numel, opened


def _changes_table(a: argparse.Namespace, root: str) -> list[str]:
    directory = f"{root}/changes"
    spawn(_save_for_changes, SAVED.world, a, directory, timeout_s=600.0)
    lines = [f"load into another layout: hidden {a.hidden[-1]}, saved at (TP, PP, DP) = "
             f"({SAVED.tp}, {SAVED.pp}, {SAVED.dp}) ZeRO-{SAVED.zero_stage}; per rank, "
             "worst of the ranks",
             f"  {'into':<14} {'TP PP DP ZeRO':>13} {'load s':>7} {'/ same':>6} "
             f"{'peak/own shard':>14} {'own shard':>10} {'files opened':>12}"]
    same = 0.0
    for layout in CHANGES:
        ranks = spawn(_load_changed, layout.world, a, layout, directory, timeout_s=600.0)
        load_s = max(r[0] for r in ranks)
        same = same or load_s
        lines.append(
            f"  {layout.name:<14} {layout.tp:>2} {layout.pp:>2} {layout.dp:>2} "
            f"{layout.zero_stage:>5} {load_s:>7.3f} {_ratio(load_s, same):>6} "
            f"{max(r[1] / r[2] for r in ranks):>13.2f}x {max(r[2] for r in ranks) / MIB:>6.1f} "
            f"MiB {min(r[3] for r in ranks):>5}-{max(r[3] for r in ranks)} of {SAVED.world}")
    return lines


# --- report ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Row:
    """One layout at one size, over its ranks."""

    params: int  # logical parameters (from the 1-rank run) or on the largest rank
    disk: int
    largest_file: int
    save_s: float  # slowest rank
    load_s: float
    build_load_s: float
    save_peak: int  # largest rank
    load_peak: int
    save_peak_sum: int  # all ranks together
    load_peak_sum: int


def _row(ranks: list[Measured]) -> Row:
    return Row(params=max(r.params for r in ranks), disk=sum(r.dir_bytes for r in ranks),
               largest_file=max(r.file_bytes for r in ranks),
               save_s=max(r.save_s for r in ranks), load_s=max(r.load_s for r in ranks),
               build_load_s=max(r.build_load_s for r in ranks),
               save_peak=max(r.save_peak for r in ranks),
               load_peak=max(r.load_peak for r in ranks),
               save_peak_sum=sum(r.save_peak for r in ranks),
               load_peak_sum=sum(r.load_peak for r in ranks))


def _ratio(x: float, base: float) -> str:
    return f"{x / base:.2f}" if base > 0 else "-"


def _table(hidden: int, rows: dict[str, Row]) -> list[str]:
    base = rows[LAYOUTS[0].name]
    lines = [f"hidden {hidden}: {base.params:,} parameters, checkpoint {base.disk / MIB:.1f} MiB "
             "on one rank",
             f"  {'layout':<20} {'on disk':>9} {'max file':>9} {'save s':>7} {'load s':>7} "
             f"{'build+load s':>12} {'save peak/rank':>15} {'load peak/rank':>15} "
             f"{'peak sum save/load':>19} | {'4r/1r: save':>11} {'load':>5} {'peak save':>9} "
             f"{'peak load':>9} {'disk':>5}"]
    for name, r in rows.items():
        ratios = "" if r is base else (
            f"{_ratio(r.save_s, base.save_s):>11} {_ratio(r.load_s, base.load_s):>5} "
            f"{_ratio(r.save_peak, base.save_peak):>9} "
            f"{_ratio(r.load_peak, base.load_peak):>9} {_ratio(r.disk, base.disk):>5}")
        lines.append(
            f"  {name:<20} {r.disk / MIB:>5.1f} MiB {r.largest_file / MIB:>5.1f} MiB "
            f"{r.save_s:>7.3f} {r.load_s:>7.3f} {r.build_load_s:>12.3f} "
            f"{r.save_peak / MIB:>11.1f} MiB {r.load_peak / MIB:>11.1f} MiB "
            f"{r.save_peak_sum / MIB:>7.0f} /{r.load_peak_sum / MIB:>6.0f} MiB | {ratios}")
    return lines


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, nargs="+", default=[256, 512, 768],
                   help="model sizes: the hidden size of each (default 256 512 768)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--dir", default=None,
                   help="where to write the checkpoints (default: a temporary directory)")
    return p.parse_args()


def main() -> None:
    a = _args()
    out, start = sys.stdout, time.perf_counter()
    out.write(f"model: GPT layers={a.layers} hidden={a.hidden} heads={a.heads} seq={a.seq} "
              f"vocab={a.vocab}, fp32 weights + Adam moments (12 bytes a parameter)\n")
    by_layout: dict[str, list[list[Measured]]] = {}
    with tempfile.TemporaryDirectory(prefix="m3d_ckpt_bench_", dir=a.dir) as root:
        for layout in LAYOUTS:
            replies = spawn(_measure, layout.world, a, layout, root, timeout_s=600.0)
            if layout is LAYOUTS[0]:
                machine, exact = replies[0][0], replies[0][1]
                out.write(f"machine (each rank, gloo on CPU): {machine}; main process: "
                          f"{devices.describe(torch.device('cpu'))}; up to "
                          f"{max(x.world for x in LAYOUTS + CHANGES)} ranks share "
                          f"{os.cpu_count()} cores\n")
                out.write("memory: " + (
                    "peak RSS above the call's start, per process (VmHWM reset via "
                    "/proc/self/clear_refs)" if exact else
                    "lifetime peak RSS from getrusage (could not reset the peak: the "
                    "figures include everything before the call)") + "; a rank's RSS "
                    "counts the pages of checkpoint files it maps, which ranks on one node "
                    "share, so the sums over ranks overstate physical memory\n")
                out.write("times: slowest rank; the load re-reads a just-written file "
                          "(page cache); save includes fsync\n")
            by_layout[layout.name] = [r for _, _, r in replies]
            out.flush()
        changes = _changes_table(a, root)
    for i, hidden in enumerate(a.hidden):
        rows = {name: _row([ranks[i] for ranks in per_rank])
                for name, per_rank in by_layout.items()}
        out.write("\n".join(_table(hidden, rows)) + "\n")
    out.write("\n".join(changes) + "\n")
    out.write(f"wall time: {time.perf_counter() - start:.1f} s\n")


if __name__ == "__main__":
    main()
