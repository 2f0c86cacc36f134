"""How many bytes does a transformer layer keep for backward, against the paper and our count?

For each TP size in ``--tp``, TP gloo processes build ``--layers`` transformer layers (GPT-2
style: LayerNorm, 4h GeLU MLP, hidden dropout 0.1) in bf16 and run one micro-batch through
them for every combination of sequence parallelism (off, on) and recompute (none, selective,
full). Saved-tensor hooks collect the distinct storages autograd keeps for backward
(``training.activation_memory.saved_bytes``; parameters and buffers left out), per layer. Each
figure is printed next to

- the paper's: Korthikanti et al. 2022, s b h (34 + 5 a s / h) bytes per layer in 16-bit
  without parallelism, / t with TP + SP, 34 s b h / t with selective recompute;
- our exact count (``training.activation_memory.layer_activation_bytes``), term by term;
- the same layout without recompute, measured in this invocation.

Attention dropout is 0: the CPU runs SDPA's flash kernel only without it (GPUs' flash
kernels apply dropout without storing anything), so the s^2 terms of the paper are never
stored; with attention dropout the CPU's math kernel keeps fp32 scores.

Then the loss: the peak bytes the vocab-parallel cross entropy allocates over forward and
backward (its gradient for the bf16 logits included, the logits themselves not), at a large
vocabulary, as a multiple of one rank's logits in fp32, next to torch's ``F.cross_entropy``
on ``logits.float()`` at TP=1 (``training.activation_memory.PeakMemory``).

    python -m benchmarks.activation_memory
    python -m benchmarks.activation_memory --tp 1 2 4 8 --hidden 512 --heads 16 --seq 256
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F  # noqa: N812

from benchmarks.common import add_model_args, spawn
from megatron3d import device as devices
from megatron3d.accounting.activations import (
    PeakMemory,
    cross_entropy_peak,
    layer_activation_bytes,
    measured_layer_bytes,
    paper_layer_bytes,
)
from megatron3d.config import ModelConfig
from megatron3d.mpu.state import AxisGroup, ParallelState

RECOMPUTE = (None, "selective", "full")
DTYPE = torch.bfloat16
CPU = torch.device("cpu")


def _config(a: argparse.Namespace, recompute: str | None) -> ModelConfig:
    return ModelConfig(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads,
                       seq_length=a.seq, vocab_size=a.vocab, hidden_dropout=0.1,
                       attention_dropout=0.0, recompute_granularity=recompute)


def _loss_peaks(a: argparse.Namespace, tp: AxisGroup) -> dict[str, int]:
    """Peak bytes of the loss on bf16 logits that exist beforehand (this rank's [s, b, v/tp]);
    at TP=1 also of torch's F.cross_entropy on ``logits.float()``."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(a.loss_seq, a.loss_micro_batch, a.loss_vocab // tp.size, generator=gen,
                         dtype=DTYPE).requires_grad_()
    labels = torch.randint(0, a.loss_vocab, (a.loss_seq, a.loss_micro_batch), generator=gen)
    peaks = {"loss": cross_entropy_peak(logits, labels, tp, a.loss_vocab)}
    if tp.size == 1:
        with PeakMemory() as peak:
            F.cross_entropy(logits.float().flatten(0, 1), labels.flatten()).backward()
        peaks["torch loss"] = peak.peak
    return peaks


def _measure(a: argparse.Namespace) -> dict:
    """One TP rank: per-layer bytes for each (SP, recompute), and the loss's peak."""
    tp = ParallelState.build(a.tp_size, 1).tp
    out: dict = {"machine": devices.describe(CPU)}
    for sp in (False, True):
        for recompute in RECOMPUTE:
            out[(sp, recompute)] = measured_layer_bytes(_config(a, recompute), a.micro_batch,
                                                        tp, sp, DTYPE)
    return out | _loss_peaks(a, tp)


def _layer_rows(a: argparse.Namespace, k: int, rank0: dict) -> list[str]:
    lines = []
    for sp in (False, True):
        baseline = rank0[(sp, None)][0]
        for recompute in RECOMPUTE:
            cfg = _config(a, recompute)
            measured = rank0[(sp, recompute)]
            if len(set(measured)) != 1:
                lines.append(f"  layers differ: {measured}")
            ours = sum(layer_activation_bytes(cfg, a.micro_batch, k, sp, DTYPE, "cpu").values())
            paper = paper_layer_bytes(cfg, a.micro_batch, k, sp)
            lines.append(f"  {k:>2}  {'on' if sp else 'off':<4}{recompute or 'none':<10}"
                         f"{measured[0]:>12,}{ours:>12,}{measured[0] / ours:>8.3f}"
                         f"{paper:>14,.0f}{measured[0] / paper:>8.3f}"
                         f"{measured[0] / baseline:>8.3f}")
    return lines


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p, layers=2)
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--loss-vocab", type=int, default=131072)
    p.add_argument("--loss-seq", type=int, default=512)
    p.add_argument("--loss-micro-batch", type=int, default=2)
    return p.parse_args()


def main() -> None:
    a = _args()
    start = time.perf_counter()
    out = sys.stdout
    out.write(f"model: {a.layers} layers, hidden={a.hidden} heads={a.heads} seq={a.seq} "
              f"micro-batch={a.micro_batch}, bf16, LayerNorm, GeLU 4h, hidden dropout 0.1, "
              "attention dropout 0; bytes each layer keeps for backward, per TP rank\n")
    header = (f"  {'TP':>2}  {'SP':<4}{'recompute':<10}{'measured B':>12}{'ours B':>12}"
              f"{'m/ours':>8}{'paper B':>14}{'m/paper':>8}{'m/none':>8}")
    layers, losses = [header], []
    for k in a.tp:
        a.tp_size = k
        ranks = spawn(_measure, k, a)
        if k == a.tp[0]:
            out.write(f"machine (each TP rank, gloo on CPU): {ranks[0]['machine']}\n")
        same = all(r == ranks[0] for r in ranks)
        layers += _layer_rows(a, k, ranks[0]) + ([] if same else [f"  TP={k}: ranks differ"])
        logits = a.loss_seq * a.loss_micro_batch * a.loss_vocab // k * 4  # fp32, one rank
        losses.append(f"  TP={k}: peak {ranks[0]['loss']:>14,} B = "
                      f"{ranks[0]['loss'] / logits:.3f} x one rank's fp32 logits "
                      f"({logits:,} B)")
        if "torch loss" in ranks[0]:
            losses.append(f"  TP={k}, torch F.cross_entropy(logits.float()): peak "
                          f"{ranks[0]['torch loss']:>14,} B = "
                          f"{ranks[0]['torch loss'] / logits:.3f} x")
    out.write("\n".join(layers) + "\n")
    out.write(f"loss: vocab-parallel cross entropy, bf16 logits [s={a.loss_seq}, "
              f"b={a.loss_micro_batch}, v={a.loss_vocab}/TP], forward + backward\n")
    out.write("\n".join(losses) + "\n")
    out.write(f"wall time: {time.perf_counter() - start:.1f} s\n")


if __name__ == "__main__":
    main()
