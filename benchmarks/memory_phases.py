"""How much memory does a rank hold at each phase of a run, and does the prediction agree?

For each layout, that many gloo processes (one thread each; on a GPU machine, CUDA ranks)
run the trainer ``pretrain_gpt.py`` builds and record each rank's peak at every phase:

- build: ``build_trainer`` (the stage on the meta device, the ZeRO buffers drawn in place,
  the optimizer);
- first step: the first training step (Adam's moments are allocated here);
- steady step: the largest of the following steps;
- evaluation: one evaluation (``--eval-iters`` batches through the pipeline, no gradients);
- save: one checkpoint save (the owned state copied into the host snapshot);
- load: a trainer built with ``--load`` of that checkpoint (build and load together), in
  fresh processes.

Each phase's figure is the peak of memory in use during the phase minus what was in use
before the build (the process, its libraries and the process group): what the framework
itself holds at the worst moment of the phase. How it is read:

- on a GPU: the CUDA caching allocator's peak of allocated bytes (``max_memory_allocated``,
  reset at each phase), the figure the allocator's own out-of-memory error compares;
- on the CPU: the process's peak resident set (Linux's ``VmHWM``, reset at each phase
  through ``/proc/self/clear_refs``). It counts every page the process touches (torch's
  allocations, gloo's buffers, the allocator's slack and the Python heap), not only
  tensors, so it can only over-state the framework's memory; pages freed by glibc but kept
  in its arenas stay counted, and so do a phase's host buffers (on a GPU machine the save's
  snapshot is pinned host memory, outside the device figure).

Next to each, the prediction the start-up report and ``check_fits`` make for that phase
(``accounting/peak.py``; both steps against its training step, the load against nothing: it
is not modelled), for the fullest pipeline rank, as tensors plus, on a GPU, the allocator's
reserve, CUDA context and NCCL communicators. On the CPU the prediction's save carries 64 MiB
of device staging and the measured save the rank's host snapshot too (12 bytes per element
it writes, host memory on a GPU machine).

    python -m benchmarks.memory_phases
    python -m benchmarks.memory_phases --layers 8 --hidden 768 --layouts 1,1,4,3
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import add_model_args, spawn
from megatron3d import device as devices
from megatron3d.accounting.fit import layout_memory
from megatron3d.checkpoint.progress import Progress
from megatron3d.cli.arguments import parse_args
from megatron3d.mpu.state import ParallelState
from megatron3d.training.build import Overrides, build_trainer
from megatron3d.training.loop import Hooks
from megatron3d.validation import validate

MIB = 2**20
PHASES = ("build", "first step", "steady step", "evaluation", "save", "load")
# (TP, PP, DP, ZeRO stage, virtual chunks per pipeline rank)
LAYOUTS = ((1, 1, 2, 0, 1), (1, 1, 2, 1, 1), (1, 1, 2, 3, 1), (2, 1, 2, 1, 1),
           (1, 2, 2, 1, 1), (1, 2, 1, 0, 2), (1, 2, 2, 3, 1))


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    zero: int
    virtual: int

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def flags(self) -> list[str]:
        extra = ([] if self.virtual == 1
                 else ["--virtual-pipeline-model-parallel-size", str(self.virtual)])
        return ["--tensor-model-parallel-size", str(self.tp), "--pipeline-model-parallel-size",
                str(self.pp), "--zero-stage", str(self.zero), *extra]

    def __str__(self) -> str:
        v = f" v={self.virtual}" if self.virtual > 1 else ""
        return f"TP{self.tp} PP{self.pp}{v} DP{self.dp} ZeRO-{self.zero}"


class PhaseMeter:
    """Peaks of memory in use above a baseline, phase by phase (``devices`` reads them)."""

    def __init__(self, dev: torch.device) -> None:
        self.dev = dev
        self.baseline = devices.reset_peak_memory(dev)
        self.peaks: dict[str, int] = {}

    def close(self, phase: str) -> None:
        """The phase that ran since the last close ends now; the next starts."""
        peak = devices.peak_memory(self.dev) - self.baseline
        self.peaks[phase] = max(self.peaks.get(phase, 0), peak)
        devices.reset_peak_memory(self.dev)


class _MeteredSaver:
    """The trainer's saver, its save measured as the "save" phase (and what ran since the
    last step, the evaluation, closed first)."""

    def __init__(self, saver: Any, meter: PhaseMeter) -> None:
        self.saver, self.meter = saver, meter

    def __call__(self, progress: Progress) -> str:
        self.meter.close("evaluation")
        directory = self.saver(progress)
        self.meter.close("save")
        return directory

    def wait(self) -> None:
        self.saver.wait()


def phase_peaks(argv: list[str], dev: torch.device, steps: int) -> dict[str, int]:
    """One rank: the peak bytes above the start of the build of each phase but "load" for
    the run ``argv`` (which must ``--save``), on the initialised process group."""
    cfg = parse_args([*argv, "--train-iters", str(steps), "--eval-interval", str(steps),
                      "--save-interval", str(steps)])
    validate(cfg, torch.distributed.get_world_size())
    state = ParallelState.build(cfg.parallel.tensor_model_parallel_size,
                                cfg.parallel.pipeline_model_parallel_size)
    meter = PhaseMeter(dev)

    def on_step(iteration: int, _result: object) -> None:
        meter.close("first step" if iteration == 1 else "steady step")

    trainer = build_trainer(cfg, state, dev, overrides=Overrides(
        hooks=Hooks(on_step=on_step), save=lambda saver: _MeteredSaver(saver, meter)))
    meter.close("build")
    trainer.run()
    return meter.peaks


def load_peak(argv: list[str], dev: torch.device) -> int:
    """One rank: the peak bytes above its start of building the trainer for ``argv`` with
    ``--load`` of the checkpoint it saved (best in a fresh process: on the CPU, memory an
    earlier trainer freed may still be resident)."""
    cfg = parse_args([*argv, "--load", parse_args(argv).checkpoint.save])
    validate(cfg, torch.distributed.get_world_size())
    state = ParallelState.build(cfg.parallel.tensor_model_parallel_size,
                                cfg.parallel.pipeline_model_parallel_size)
    meter = PhaseMeter(dev)
    build_trainer(cfg, state, dev)
    meter.close("load")
    return meter.peaks["load"]


# Appended to a run's flags: the same layout and path through the code at a width that costs
# nothing, run first so that what the first use of each code path maps in (library pages, the
# allocator's arenas) is not counted as the real run's memory.
WARM_UP = ["--hidden-size", "64", "--num-attention-heads", "4"]


def _rank(argv: list[str], steps: int) -> tuple[str, dict[str, int]]:
    dev = devices.device()
    phase_peaks([*argv, *WARM_UP, "--save", _warm_dir(argv)], dev, steps)
    return devices.describe(dev), phase_peaks(argv, dev, steps)


def _rank_load(argv: list[str], steps: int) -> int:
    dev = devices.device()
    load_peak([*argv, *WARM_UP, "--save", _warm_dir(argv), "--train-iters", str(steps)], dev)
    return load_peak([*argv, "--train-iters", str(steps)], dev)


def _warm_dir(argv: list[str]) -> str:
    return parse_args(argv).checkpoint.save + "-warm-up"


def _argv(a: argparse.Namespace, layout: Layout, directory: str) -> list[str]:
    return ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden),
            "--num-attention-heads", str(a.heads), "--seq-length", str(a.seq),
            "--micro-batch-size", str(a.micro_batch), "--global-batch-size",
            str(a.micro_batch * layout.dp * a.micro_batches), "--lr", "1e-4", "--mock-data",
            "--vocab-size", str(a.vocab), "--eval-iters", "1", "--log-interval", "1000",
            "--save", directory, *layout.flags()]


def _layouts(text: list[str] | None) -> list[Layout]:
    if not text:
        return [Layout(*row) for row in LAYOUTS]
    return [Layout(*(int(x) for x in (row.split(",") + ["1"])[:5])) for row in text]


MODELLED = {"build": "build", "first step": "train", "steady step": "train",
            "evaluation": "evaluate", "save": "save"}


def predicted(argv: list[str], world: int, steps: int, device_type: str) -> dict[str, int]:
    """The fullest pipeline rank's predicted peak of each modelled phase, in bytes."""
    cfg = parse_args([*argv, "--train-iters", str(steps)])
    validate(cfg, world)
    ranks = layout_memory(cfg, world, device_type)
    return {phase: max(r.phase(MODELLED[phase]).total for r in ranks) for phase in MODELLED}


def _table(layout: Layout, ranks: list[dict[str, int]], model: dict[str, int]) -> list[str]:
    lines = [f"{layout} (the fullest rank per phase, MiB above the start of the build):",
             f"  {'phase':<12} {'measured':>9} {'predicted':>9} {'ratio':>6}"]
    for phase in PHASES:
        worst = max(r[phase] for r in ranks)
        guess = model.get(phase)
        cells = ("-", "-") if guess is None else (f"{guess / MIB:.1f}", f"{worst / guess:.2f}")
        lines.append(f"  {phase:<12} {worst / MIB:>9.1f} {cells[0]:>9} {cells[1]:>6}")
    return lines


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p, layers=8, hidden=512, heads=8, seq=128, micro_batch=2, vocab=8192)
    p.add_argument("--micro-batches", type=int, default=4, help="per step and DP rank")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--layouts", nargs="*", metavar="TP,PP,DP,ZERO[,V]",
                   help="default: the seven of LAYOUTS")
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary "
                   "directory)")
    return p.parse_args()


def main() -> None:
    a = _args()
    out, start = sys.stdout, time.perf_counter()
    out.write(f"model: GPT layers={a.layers} hidden={a.hidden} heads={a.heads} seq={a.seq} "
              f"vocab={a.vocab} micro-batch={a.micro_batch} x {a.micro_batches} per DP rank, "
              "fp32\n")
    with tempfile.TemporaryDirectory(prefix="m3d_phases_", dir=a.dir) as root:
        for k, layout in enumerate(_layouts(a.layouts)):
            argv = _argv(a, layout, str(Path(root) / f"ckpt{k}"))
            replies = spawn(_rank, layout.world, argv, a.steps, timeout_s=1800.0)
            loads = spawn(_rank_load, layout.world, argv, a.steps, timeout_s=1800.0)
            if k == 0:
                out.write(f"machine (each rank): {replies[0][0]}\n")
            ranks = [{**peaks, "load": load} for (_, peaks), load in zip(replies, loads,
                                                                         strict=True)]
            model = predicted(argv, layout.world, a.steps, devices.device().type)
            out.write("\n".join(_table(layout, ranks, model)) + "\n")
            out.flush()
    out.write(f"wall time: {time.perf_counter() - start:.1f} s\n")


if __name__ == "__main__":
    main()
