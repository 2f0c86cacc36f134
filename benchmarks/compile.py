"""How much faster is a training step with compiled layers (--compile), and how long does
compiling take, cold and from the cache?

For each model (the quickstart's shape, and a larger one: 8 layers, hidden 512, seq 512;
each with the quickstart's GPT-2 layer and with Llama's: RMSNorm, RoPE, SwiGLU) one fresh
process builds the eager trainer and the compiled one (same weights, same micro-batches:
pretrain_gpt.py's trainer stepped by ``train_step``) into an empty compile cache, and times
their steps interleaved (eager, compiled, eager, ...), so machine noise hits both alike: the
ratio of median step times, target <= 0.90, in wall time and in the process's CPU time
(which other jobs on a shared machine disturb less). The compiled trainer's first step less
its median is the cold compile (target <= 60 s). A second fresh process over the same cache
times the warm start the same way (target <= 10 s).

    python -m benchmarks.compile                       # both shapes x both flavours, 1 thread
    python -m benchmarks.compile --models quickstart --flavours gpt2 --steps 10
    python -m benchmarks.compile --precision bf16
    python -m benchmarks.compile --dropout 0.1 --inductor-random   # inductor's own RNG on the CPU
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

from benchmarks.common import spawn
from megatron3d import device as devices
from megatron3d.cli.arguments import parse_args
from megatron3d.mpu.state import ParallelState
from megatron3d.training.build import build_trainer
from megatron3d.training.loop import Trainer
from megatron3d.training.step import train_step
from megatron3d.validation import validate

MODELS = {  # layers, hidden, heads, seq, micro-batch, vocab
    "quickstart": (2, 64, 4, 64, 4, 2048),
    "large": (8, 512, 8, 512, 1, 8192),
}
FLAVOURS = {  # the quickstart's GPT-2 layer (LayerNorm, GeLU), and Llama's
    "gpt2": (),
    "llama": ("--position-embedding-type", "rope", "--normalization", "rmsnorm", "--swiglu",
              "--untie-embeddings-and-output-weights", "--disable-bias-linear"),
}


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="quickstart,large", help="comma-separated: "
                   + ", ".join(MODELS))
    p.add_argument("--flavours", default="gpt2,llama", help="comma-separated: "
                   + ", ".join(FLAVOURS))
    p.add_argument("--steps", type=int, default=6, help="timed steps of each trainer")
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="the layers' dtype (bf16/fp16: mixed precision, fp32 master weights)")
    p.add_argument("--dropout", type=float, default=0.0, help="hidden and attention dropout")
    p.add_argument("--inductor-random", action="store_true",
                   help="inductor's generated random numbers instead of torch's random ops "
                   "(fallback_random, which --compile sets on the CPU)")
    return p.parse_args()


def _argv(model: str, a: argparse.Namespace, *extra: str) -> list[str]:
    """``model`` is SHAPE/FLAVOUR."""
    shape, flavour = model.split("/")
    layers, hidden, heads, seq, micro, vocab = MODELS[shape]
    return ["--num-layers", str(layers), "--hidden-size", str(hidden),
            "--num-attention-heads", str(heads), "--seq-length", str(seq),
            "--micro-batch-size", str(micro), "--global-batch-size", str(micro * a.micro_batches),
            "--train-iters", "1", "--lr", "1e-4", "--mock-data", "--vocab-size", str(vocab),
            "--hidden-dropout", str(a.dropout), "--attention-dropout", str(a.dropout),
            *([f"--{a.precision}"] if a.precision != "fp32" else []), *FLAVOURS[flavour],
            *extra]


def _trainer(argv: list[str], state: ParallelState) -> Trainer:
    cfg = parse_args(argv)
    validate(cfg, state.world_size)
    return build_trainer(cfg, state, devices.device())


def _timer(trainer: Trainer):
    batches = trainer.data.train(0, trainer.batch_schedule.global_batch_size_at(0))
    model = trainer.model

    def step() -> tuple[float, float]:
        """(wall, this process's CPU time) of one step: on a shared machine the CPU time
        counts only this process's work, the wall time every other job's too."""
        start, cpu = time.perf_counter(), time.process_time()
        train_step(model.engine, model.optimizer, batches, 1e-4, model.grad_sync, model.dp)
        return time.perf_counter() - start, time.process_time() - cpu
    return step


def _measure(model: str, a: argparse.Namespace, cache: str, with_eager: bool) -> dict:
    """One process: the compiled trainer's first step and median step, and with
    ``with_eager`` the eager trainer's median, their steps interleaved."""
    torch.set_num_threads(a.threads)
    state = ParallelState.build(1, 1)
    compiled = _timer(_trainer(_argv(model, a, "--compile", "--compile-cache-dir", cache),
                               state))
    if a.inductor_random:  # after the build set it, before the first step compiles
        torch._inductor.config.fallback_random = False
    first, _ = compiled()
    eager = _timer(_trainer(_argv(model, a), state)) if with_eager else None
    times: dict[str, list[tuple[float, float]]] = {"compiled": [], "eager": []}
    for i in range(a.steps):
        order = [("compiled", compiled), ("eager", eager)]
        for name, step in (order if i % 2 else order[::-1]):
            if step is not None:
                times[name].append(step())
    medians = {k: statistics.median(w for w, _ in v) for k, v in times.items() if v}
    cpu = {f"{k}_cpu": statistics.median(c for _, c in v) for k, v in times.items() if v}
    return {"first": first, **medians, **cpu}


def _report(model: str, cold: dict, warm: dict) -> str:
    ratio = cold["compiled"] / cold["eager"]
    cpu = cold["compiled_cpu"] / cold["eager_cpu"]
    return (f"{model}: step eager {cold['eager'] * 1e3:.1f} ms, compiled "
            f"{cold['compiled'] * 1e3:.1f} ms, ratio {ratio:.3f} (target <= 0.90), in CPU "
            f"time {cold['eager_cpu'] * 1e3:.1f} and {cold['compiled_cpu'] * 1e3:.1f} ms, "
            f"ratio {cpu:.3f}; compile "
            f"cold {cold['first'] - cold['compiled']:.1f} s (<= 60), warm "
            f"{warm['first'] - warm['compiled']:.1f} s (<= 10)")


def main() -> None:
    a = _args()
    sys.stdout.write(f"load average {os.getloadavg()}, threads {a.threads}, {a.precision}, "
                     f"dropout {a.dropout}, inductor random {a.inductor_random}, torch "
                     f"{torch.__version__}\n")
    models = [f"{m}/{f}" for m in a.models.split(",") for f in a.flavours.split(",")]
    for model in models:
        with tempfile.TemporaryDirectory(prefix="m3d_compile_cache_") as cache:
            [cold] = spawn(_measure, 1, model, a, cache, True, timeout_s=3600)
            [warm] = spawn(_measure, 1, model, a, cache, False, timeout_s=3600)
        sys.stdout.write(_report(model, cold, warm) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
