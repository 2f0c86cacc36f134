"""What do local checkpoints at every step cost: step time with --non-persistent-save-interval
1 against the same run without, in one run of the benchmark (same processes, same machine).

``world`` gloo ranks (DP, ZeRO-1) build the trainer ``pretrain_gpt.py`` builds, twice, for
the same steps: without local saves (the baseline), then with ``--non-persistent-save-interval
1`` (``--non-persistent-ckpt-type memory`` under ``--dir``, default /dev/shm: host memory).
A step's time is the wall time between the ends of consecutive steps (``Hooks.on_step``),
so a step carries its save's part on the training thread (waiting for the save before, the
copy to host memory: on a GPU, a device-to-host copy and one sync at the save point, as a
global save's) and the background thread's share of the cores (the finiteness check, writing
the rank file, replicating it to the peer, the barrier). A step is ``--accumulation``
micro-batches per rank (8 by default; a real run has hundreds, and the save's cost is per
step while the compute grows with them). The ratio is the median step with
saves over the median step without, first steps left out (warm-up). On a CPU machine the
writer thread competes with the training processes for the same cores; with GPUs it
competes only for host cores.

    python -m benchmarks.local_save
    python -m benchmarks.local_save --hidden 512 --steps 30 --world 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

from benchmarks.common import add_model_args, spawn
from megatron3d import device as devices
from megatron3d.cli.arguments import parse_args
from megatron3d.mpu.state import ParallelState
from megatron3d.training.build import Overrides, build_trainer
from megatron3d.training.loop import Hooks
from megatron3d.validation import validate

WARMUP = 3  # steps left out of the medians


def argv(a: argparse.Namespace, world: int, local_root: str | None) -> list[str]:
    """The benchmark's command line; with ``local_root``, local saves at every step."""
    local = ([] if local_root is None else
             ["--non-persistent-save-interval", "1", "--non-persistent-ckpt-type", "memory",
              "--non-persistent-local-ckpt-dir", local_root])
    return ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden),
            "--num-attention-heads", str(a.heads), "--seq-length", str(a.seq),
            "--micro-batch-size", str(a.micro_batch),
            "--global-batch-size", str(a.micro_batch * world * a.accumulation),
            "--train-iters", str(a.steps), "--lr", "1e-4", "--lr-decay-style", "constant",
            "--mock-data", "--vocab-size", str(a.vocab), "--zero-stage", "1",
            "--eval-iters", "0", "--log-interval", "1000", *local]


def _steps(a: argparse.Namespace, world: int, local_root: str | None) -> list[float]:
    """One rank: the duration of each step after the first."""
    cfg = parse_args(argv(a, world, local_root))
    validate(cfg, world)
    ends: list[float] = []
    trainer = build_trainer(cfg, ParallelState.build(1, 1), torch.device("cpu"),
                            overrides=Overrides(hooks=Hooks(
                                on_step=lambda it, _: ends.append(time.perf_counter()))))
    trainer.run()
    return [b - e for e, b in zip(ends, ends[1:], strict=False)]


def _run(a: argparse.Namespace, world: int, root: str) -> dict[str, Any]:
    """One rank: both runs, alternated ``a.repeats`` times in the same process (so that a
    change in the machine's load weighs on both alike)."""
    found: dict[str, Any] = {"baseline": [], "local": [],
                             "machine": devices.describe(torch.device("cpu"))}
    for _ in range(a.repeats):
        found["baseline"] += _steps(a, world, None)[WARMUP:]
        found["local"] += _steps(a, world, root)[WARMUP:]
    return found


def local_save_cost(a: argparse.Namespace, world: int, root: str) -> dict[str, float]:
    """Median step seconds without and with local saves at every step (slowest rank's
    median), and their ratio: what ``benchmarks/recovery.py`` reports as the save cost."""
    ranks = spawn(_run, world, a, world, root, timeout_s=900)
    base = max(statistics.median(r["baseline"]) for r in ranks)
    local = max(statistics.median(r["local"]) for r in ranks)
    return {"baseline_s": base, "local_s": local, "ratio": local / base,
            "machine": ranks[0]["machine"]}


def add_cost_args(p: argparse.ArgumentParser) -> None:
    """The shape and length of the cost runs (``benchmarks/recovery.py`` takes them too)."""
    add_model_args(p)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=2, help="runs of each kind, alternated")
    p.add_argument("--accumulation", type=int, default=8,
                   help="micro-batches per rank per step (a real run has hundreds)")
    p.add_argument("--world", type=int, default=2, help="gloo ranks (DP, ZeRO-1)")


def main(args: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_cost_args(p)
    p.add_argument("--dir", default="/dev/shm", help="root of the local store")
    a = p.parse_args(args)
    with tempfile.TemporaryDirectory(prefix="m3d_local_", dir=a.dir) as root:
        found = local_save_cost(a, a.world, root)
    sys.stdout.write(f"{found['machine']}; {a.world} ranks, hidden {a.hidden}, {a.layers} "
                     f"layers, seq {a.seq}, micro-batch {a.micro_batch} x {a.accumulation}\n"
                     f"median step without local saves: {found['baseline_s'] * 1e3:.1f} ms\n"
                     f"median step with a local save every step: {found['local_s'] * 1e3:.1f} "
                     f"ms\nratio: {found['ratio']:.3f} ({(found['ratio'] - 1) * 100:+.1f}%)\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
