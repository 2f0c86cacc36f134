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
- on the CPU, two figures:
  - tensors: the most bytes of tensor storage alive at once, every storage an operator
    creates counted from its creation until it is freed (``accounting.activations.
    PeakMemory``, a dispatch mode around the whole run): what the GPU allocator's figure
    counts, without its rounding; kernels' internal scratch and gloo's buffers are not
    tensors and are missed;
  - RSS: the process's peak resident set (Linux's ``VmHWM``, reset at each phase through
    ``/proc/self/clear_refs`` after the C heap's free pages are given back). It counts every
    page the process touches (torch's allocations, gloo's buffers, the Python heap), so it
    can only over-state the framework's memory: glibc keeps pages a step freed for the next
    step's allocations, so the later phases carry the earlier ones' high-water mark.
  The save's host snapshot (12 bytes per element the rank writes; pinned host memory on a GPU
  machine) is taken out of both: the prediction, like a GPU's figure, leaves it out.

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
import contextlib
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import add_model_args, spawn
from megatron3d import device as devices
from megatron3d.accounting.activations import PeakMemory
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
    """Peaks of memory in use above a baseline, phase by phase (``devices`` reads them), and
    on the CPU the peak of tensor storage (``tensors``)."""

    def __init__(self, dev: torch.device, tensors: PeakMemory | None) -> None:
        self.dev, self.tensors = dev, tensors
        self.baseline = devices.reset_peak_memory(dev)
        self.peaks: dict[str, int] = {}

    def close(self, phase: str, host: int = 0) -> None:
        """The phase that ran since the last close ends now; the next starts. ``host``:
        bytes of host buffers the phase made, taken out of the CPU's figures."""
        host = host if self.dev.type == "cpu" else 0
        peak = devices.peak_memory(self.dev) - self.baseline - host
        self.peaks[phase] = max(self.peaks.get(phase, 0), peak)
        if self.tensors is not None:
            key = f"{phase} tensors"
            self.peaks[key] = max(self.peaks.get(key, 0), self.tensors.peak - host)
            self.tensors.new_window()
        devices.reset_peak_memory(self.dev)


class _MeteredSaver:
    """The trainer's saver, its first save measured as the "save" phase (and what ran since
    the last step, the evaluation, closed first). On the CPU the save's host snapshot is
    taken out of its figures: it is host memory (pinned on a GPU machine), which the device's
    figure and the prediction leave out."""

    def __init__(self, saver: Any, meter: PhaseMeter) -> None:
        self.saver, self.meter, self.saved = saver, meter, False

    def __call__(self, progress: Progress) -> str:
        if self.saved:  # the run's final save of the same iteration, or a later one
            return self.saver(progress)
        self.meter.close("evaluation")
        directory = self.saver(progress)
        self.meter.close("save", host=self.saver.host_bytes)
        self.saved = True
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
    with _tensors(dev) as tensors:
        meter = PhaseMeter(dev, tensors)

        def on_step(iteration: int, _result: object) -> None:
            meter.close("first step" if iteration == 1 else "steady step")

        trainer = build_trainer(cfg, state, dev, overrides=Overrides(
            hooks=Hooks(on_step=on_step), save=lambda saver: _MeteredSaver(saver, meter)))
        meter.close("build")
        trainer.run()
    return meter.peaks


def _tensors(dev: torch.device) -> contextlib.AbstractContextManager:
    """Counting tensor storage on the CPU (a GPU's allocator counts it already)."""
    return PeakMemory() if dev.type == "cpu" else contextlib.nullcontext()


def load_peak(argv: list[str], dev: torch.device) -> dict[str, int]:
    """One rank: the peak bytes above its start of building the trainer for ``argv`` with
    ``--load`` of the checkpoint it saved (best in a fresh process: on the CPU, memory an
    earlier trainer freed may still be resident)."""
    cfg = parse_args([*argv, "--load", parse_args(argv).checkpoint.save])
    validate(cfg, torch.distributed.get_world_size())
    state = ParallelState.build(cfg.parallel.tensor_model_parallel_size,
                                cfg.parallel.pipeline_model_parallel_size)
    with _tensors(dev) as tensors:
        meter = PhaseMeter(dev, tensors)
        build_trainer(cfg, state, dev)
        meter.close("load")
    return meter.peaks


# Appended to a run's flags: the same layout and path through the code at a width that costs
# nothing, run first so that what the first use of each code path maps in (library pages, the
# allocator's arenas) is not counted as the real run's memory.
WARM_UP = ["--hidden-size", "64", "--num-attention-heads", "4"]


def _rank(argv: list[str], steps: int) -> tuple[str, dict[str, int]]:
    dev = devices.device()
    phase_peaks([*argv, *WARM_UP, "--save", _warm_dir(argv)], dev, steps)
    return devices.describe(dev), phase_peaks(argv, dev, steps)


def _rank_load(argv: list[str], steps: int) -> dict[str, int]:
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
    """Per phase the fullest rank's peaks (MiB): the device's figure (RSS on the CPU), tensor
    storage (CPU only), the prediction, and tensors (or the device's figure) / prediction."""
    tracked = f"{PHASES[0]} tensors" in ranks[0]
    lines = [f"{layout} (the fullest rank per phase, MiB above the start of the build):",
             f"  {'phase':<12} {'RSS' if tracked else 'allocator':>9} "
             f"{'tensors' if tracked else '':>9} {'predicted':>9} {'ratio':>6}"]
    for phase in PHASES:
        device = max(r[phase] for r in ranks)
        tensors = max(r[f"{phase} tensors"] for r in ranks) if tracked else None
        guess, measured = model.get(phase), tensors if tracked else device
        cells = ("-", "-") if guess is None else (f"{guess / MIB:.1f}", f"{measured / guess:.2f}")
        shown = "" if tensors is None else f"{tensors / MIB:.1f}"
        lines.append(f"  {phase:<12} {device / MIB:>9.1f} {shown:>9} {cells[0]:>9} "
                     f"{cells[1]:>6}")
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
            ranks = [{**peaks, **load} for (_, peaks), load in zip(replies, loads, strict=True)]
            model = predicted(argv, layout.world, a.steps, devices.device().type)
            out.write("\n".join(_table(layout, ranks, model)) + "\n")
            out.flush()
    out.write(f"wall time: {time.perf_counter() - start:.1f} s\n")


if __name__ == "__main__":
    main()
