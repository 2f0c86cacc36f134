"""How much does megatron3d's training step cost over a minimal plain-PyTorch loop?

Both loops train the same GPT (same weights, same micro-batches, same math: AdamW with
decoupled weight decay on the same parameter groups, global-norm clipping, mean micro-batch
loss). Ours is exactly what pretrain_gpt.py runs: the trainer built by ``build_trainer``,
stepped by ``train_step`` (pipeline engine, flat fp32 gradient buffers, grad stats, optimizer).
The steps are interleaved (ours, plain, ours, plain, ...) in one process so machine
noise hits both alike, and the ratio of median step times is printed. Target: <= 1.03.

    python benchmarks/overhead.py                  # CPU-sized model
    python benchmarks/overhead.py --hidden 1024 --layers 8 --seq 1024 --bf16   # on a GPU
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import add_model_args  # noqa: E402
from megatron3d import device as devices  # noqa: E402
from megatron3d.arguments import parse_args  # noqa: E402
from megatron3d.model.context import LayerContext  # noqa: E402
from megatron3d.model.gpt import build_gpt  # noqa: E402
from megatron3d.mpu.meta import get_meta  # noqa: E402
from megatron3d.mpu.state import AxisGroup, ParallelState  # noqa: E402
from megatron3d.training.build import build_trainer  # noqa: E402
from megatron3d.training.step import train_step  # noqa: E402
from megatron3d.validation import validate  # noqa: E402


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p, micro_batch=4)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--steps", type=int, default=20, help="timed steps per loop")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--bf16", action="store_true")
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


def main() -> None:
    a = _args()
    dev = devices.device()
    cfg = parse_args([
        "--num-layers", str(a.layers), "--hidden-size", str(a.hidden),
        "--num-attention-heads", str(a.heads), "--seq-length", str(a.seq),
        "--micro-batch-size", str(a.micro_batch),
        "--global-batch-size", str(a.micro_batch * a.micro_batches), "--train-iters", "1",
        "--lr", "1e-4", "--weight-decay", "0.1", "--clip-grad", "1.0", "--mock-data",
        "--vocab-size", str(a.vocab), "--hidden-dropout", "0", "--attention-dropout", "0",
        *(["--bf16"] if a.bf16 else [])])
    validate(cfg, 1)
    trainer = build_trainer(cfg, ParallelState.single(), dev)
    dtype = trainer.engine.dtype
    ctx = LayerContext(cfg.model, AxisGroup.single(), cfg.training.seed, dtype, dev)
    plain = build_gpt(ctx)  # identical weights: init depends only on seed and names
    decay = [p for p in plain.parameters() if not get_meta(p).no_weight_decay]
    no_decay = [p for p in plain.parameters() if get_meta(p).no_weight_decay]
    plain_opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=1e-4,
                                  foreach=dev.type == "cpu", fused=dev.type == "cuda")
    gbs = a.micro_batch * a.micro_batches
    batches = trainer.train_batches(0, gbs)

    runs = {
        "megatron3d": lambda: train_step(trainer.engine, trainer.optimizer, batches, 1e-4,
                                         trainer.grad_sync, trainer.dp),
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


if __name__ == "__main__":
    main()
