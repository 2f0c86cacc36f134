"""How much does megatron3d's training step cost over a minimal plain-PyTorch loop?

Both loops train the same GPT (same weights, same micro-batches, same math: AdamW with
decoupled weight decay on the same parameter groups, global-norm clipping, mean micro-batch
loss). The steps are interleaved (ours, plain, ours, plain, ...) in one process so machine
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

from megatron3d import device as devices  # noqa: E402
from megatron3d.config import ModelConfig, OptimizerConfig, PrecisionConfig  # noqa: E402
from megatron3d.data.mock import MockGPTDataset  # noqa: E402
from megatron3d.data.sampler import micro_batches  # noqa: E402
from megatron3d.model.context import LayerContext  # noqa: E402
from megatron3d.model.gpt import build_gpt, lm_loss  # noqa: E402
from megatron3d.mpu.meta import get_meta  # noqa: E402
from megatron3d.mpu.state import AxisGroup  # noqa: E402
from megatron3d.optim.flat_buffers import FlatBuffers  # noqa: E402
from megatron3d.optim.mixed_precision import MixedPrecisionOptimizer  # noqa: E402
from megatron3d.training.step import train_step  # noqa: E402


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--micro-batch", type=int, default=4)
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
    dtype = torch.bfloat16 if a.bf16 else torch.float32
    cfg = ModelConfig(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads,
                      seq_length=a.seq, vocab_size=a.vocab, hidden_dropout=0.0,
                      attention_dropout=0.0)
    ctx = LayerContext(cfg, AxisGroup.single(), seed=1, params_dtype=dtype, device=dev)
    ours = build_gpt(ctx)
    plain = build_gpt(ctx)  # identical weights: init depends only on seed and names
    optim_cfg = OptimizerConfig(lr=1e-4, weight_decay=0.1, clip_grad=1.0)
    optimizer = MixedPrecisionOptimizer(FlatBuffers(list(ours.parameters())), optim_cfg,
                                        PrecisionConfig(bf16=a.bf16), norm_axes=[])
    decay = [p for p in plain.parameters() if not get_meta(p).no_weight_decay]
    no_decay = [p for p in plain.parameters() if get_meta(p).no_weight_decay]
    plain_opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=1e-4,
                                  foreach=dev.type == "cpu", fused=dev.type == "cuda")
    data = MockGPTDataset(a.vocab, a.seq, seed=1)
    gbs = a.micro_batch * a.micro_batches
    batches = micro_batches(data, 0, gbs, a.micro_batch, 0, 1, dev)
    loss_fn = lambda logits, b: lm_loss(logits, b.labels, b.loss_mask, ctx)  # noqa: E731

    runs = {
        "megatron3d": lambda: train_step(ours, optimizer, batches, loss_fn, 1e-4),
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
