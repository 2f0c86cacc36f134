"""How much does megatron3d's training step cost over a minimal plain-PyTorch loop, and what
do the flight recorder and the hang watchdog add to it?

Both loops train the same GPT (same weights, same micro-batches, same math: AdamW with
decoupled weight decay on the same parameter groups, global-norm clipping, mean micro-batch
loss). Ours is exactly what pretrain_gpt.py runs: the trainer built by ``build_trainer``,
stepped by ``train_step`` (pipeline engine, flat fp32 gradient buffers, grad stats, optimizer).
The steps are interleaved (ours, plain, ours, plain, ...) in one process so machine
noise hits both alike, and the ratio of median step times is printed. Target: <= 1.03.

The second part (``--resilience-world``, default 4 ranks at PP=2 x DP=2 on gloo, where
collectives exist to record) alternates short blocks of steps without and with the recorder
(traffic and engine observer) and a running watchdog that gets a heartbeat per step, and
prints the ratio of median step times plus the recorder's measured cost per operation times
the operations per step. Target: under 1%.

    python -m benchmarks.overhead                  # CPU-sized model
    python -m benchmarks.overhead --hidden 1024 --layers 8 --seq 1024 --bf16   # on a GPU
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F  # noqa: N812

from benchmarks.common import add_model_args, spawn
from megatron3d import device as devices
from megatron3d.cli.arguments import parse_args
from megatron3d.model.context import LayerContext
from megatron3d.model.gpt import build_gpt
from megatron3d.mpu import traffic
from megatron3d.mpu.meta import get_meta
from megatron3d.mpu.state import AxisGroup, ParallelState
from megatron3d.resilience.flight_recorder import FlightRecorder
from megatron3d.resilience.watchdog import Watchdog
from megatron3d.training.build import build_trainer
from megatron3d.training.step import train_step
from megatron3d.validation import validate


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p, micro_batch=4)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--steps", type=int, default=20, help="timed steps per loop")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--resilience-world", type=int, default=4,
                   help="ranks for the recorder/watchdog part (PP=2 x DP=world/2); 0 skips it")
    p.add_argument("--blocks", type=int, default=12, help="recorder part: off/on block pairs")
    return p.parse_args()


def _plain_step(model, opt, batches, clip: float, lr: float) -> None:
    """The minimal loop: zero, forward/backward each micro-batch, clip, step."""
    opt.zero_grad(set_to_none=True)
    for b in batches:
        logits = model(b.tokens)  # [s, b, v]
        loss = F.cross_entropy(logits.float().flatten(0, 1), b.labels.t().flatten())
        (loss / len(batches)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    for group in opt.param_groups:
        group["lr"] = lr
    opt.step()


def _argv(a: argparse.Namespace, dp: int = 1, pp: int = 1) -> list[str]:
    return ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden),
            "--num-attention-heads", str(a.heads), "--seq-length", str(a.seq),
            "--micro-batch-size", str(a.micro_batch), "--pipeline-model-parallel-size", str(pp),
            "--global-batch-size", str(a.micro_batch * a.micro_batches * dp),
            "--train-iters", "1", "--lr", "1e-4", "--weight-decay", "0.1", "--clip-grad", "1.0",
            "--mock-data", "--vocab-size", str(a.vocab), "--hidden-dropout", "0",
            "--attention-dropout", "0", *(["--bf16"] if a.bf16 else [])]


RETURNED = (None,)


def _with_and_without_recorder(a: argparse.Namespace) -> dict[str, float]:
    """One rank: alternate blocks of plain steps and steps under recorder + watchdog."""
    state = ParallelState.build(1, 2)
    cfg = parse_args(_argv(a, dp=state.dp.size, pp=2))
    validate(cfg, state.world_size)
    trainer = build_trainer(cfg, state, devices.device())
    batches = trainer.data.train(0, trainer.batch_schedule.global_batch_size_at(0))
    recorder = FlightRecorder(cfg.resilience.flight_recorder_size)
    times: dict[str, list[float]] = {"off": [], "on": []}

    def step() -> float:
        start = time.perf_counter()
        model = trainer.model
        train_step(model.engine, model.optimizer, batches, 1e-4, model.grad_sync, model.dp)
        return time.perf_counter() - start

    def recorded_steps(tmp: str, block: int) -> list[float]:
        in_tmp = dataclasses.replace(cfg.resilience, hang_dump_dir=tmp)
        watchdog = Watchdog.for_run(dataclasses.replace(cfg, resilience=in_tmp), state,
                                    recorder).start()
        trainer.model.engine.observers.append(recorder)
        with traffic.observing(recorder):
            result = []
            for i in range(2):
                result.append(step())
                watchdog.beat(block * 2 + i)
        trainer.model.engine.observers.remove(recorder)
        watchdog.stop()
        return result

    with tempfile.TemporaryDirectory() as tmp:
        for block in range(a.warmup + a.blocks):  # off-on, on-off, ...: order effects cancel
            order = ("off", "on") if block % 2 == 0 else ("on", "off")
            measured = {mode: recorded_steps(tmp, block) if mode == "on" else
                        [step() for _ in range(2)] for mode in order}
            if block >= a.warmup:
                for mode, values in measured.items():
                    times[mode] += values
    ops_per_step = recorder.ops[-1].seq / (2 * (a.warmup + a.blocks))
    probe = FlightRecorder(1024)
    x = torch.zeros(16, 4, 8)
    start = time.perf_counter()
    for _ in range(20_000):  # as comm tells it a blocking collective: issued, then returned
        probe("all_reduce", x, state.dp)
        probe.posted(RETURNED)
    per_op = (time.perf_counter() - start) / 20_000
    return {"off": statistics.median(times["off"]), "on": statistics.median(times["on"]),
            "ops": ops_per_step, "per_op": per_op}


def _resilience_report(a: argparse.Namespace) -> str:
    ranks = spawn(_with_and_without_recorder, a.resilience_world, a, timeout_s=1800)
    off = max(r["off"] for r in ranks)
    on = max(r["on"] for r in ranks)
    worst = max(ranks, key=lambda r: r["ops"] * r["per_op"] / r["off"])
    estimate = worst["ops"] * worst["per_op"] / worst["off"]
    return (f"flight recorder + watchdog at PP=2 x DP={a.resilience_world // 2} "
            f"({a.resilience_world} gloo ranks, {2 * a.blocks} steps each way in blocks of 2):\n"
            f"median step (slowest rank): without {off * 1e3:.1f} ms, with {on * 1e3:.1f} ms; "
            f"ratio {on / off:.4f}\n"
            f"recorder cost: {worst['per_op'] * 1e6:.2f} us per operation x {worst['ops']:.0f} "
            f"operations per step = {estimate * 100:.3f}% of a step  (target < 1%)\n")


def main() -> None:
    a = _args()
    dev = devices.device()
    cfg = parse_args(_argv(a))
    validate(cfg, 1)
    trainer = build_trainer(cfg, ParallelState.single(), dev)
    dtype = trainer.model.engine.dtype
    ctx = LayerContext(cfg.model, AxisGroup.single(), cfg.training.seed, dtype, dev)
    plain = build_gpt(ctx)  # identical weights: init depends only on seed and names
    decay = [p for p in plain.parameters() if not get_meta(p).no_weight_decay]
    no_decay = [p for p in plain.parameters() if get_meta(p).no_weight_decay]
    plain_opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=1e-4,
                                  foreach=dev.type == "cpu", fused=dev.type == "cuda")
    gbs = a.micro_batch * a.micro_batches
    batches = trainer.data.train(0, gbs)

    runs = {
        "megatron3d": lambda m=trainer.model: train_step(m.engine, m.optimizer, batches, 1e-4,
                                                         m.grad_sync, m.dp),
        "plain": lambda: _plain_step(plain, plain_opt, batches, 1.0, 1e-4),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(a.warmup + a.steps):
        for name, run in runs.items():
            devices.synchronize(dev)
            start = time.perf_counter()
            run()
            devices.synchronize(dev)
            if i >= a.warmup:
                times[name].append(time.perf_counter() - start)

    ours_s, plain_s = (statistics.median(times[n]) for n in ("megatron3d", "plain"))
    sys.stdout.write(
        f"machine: {devices.describe(dev)}\n"
        f"model: layers={a.layers} hidden={a.hidden} seq={a.seq} vocab={a.vocab} "
        f"micro-batch={a.micro_batch} x {a.micro_batches} dtype={dtype}\n"
        f"median step: megatron3d {ours_s * 1e3:.1f} ms, plain PyTorch {plain_s * 1e3:.1f} ms "
        f"over {a.steps} interleaved steps each\n"
        f"overhead ratio (megatron3d / plain): {ours_s / plain_s:.3f}  (target <= 1.03)\n")
    if a.resilience_world:
        sys.stdout.write(_resilience_report(a))


if __name__ == "__main__":
    main()
