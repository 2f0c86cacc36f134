"""What does context parallelism save per rank, how evenly does it split the causal work, and
what does a step cost against data parallelism at equal tokens?

Four parts, every ratio measured in this invocation:

(a) activation memory: for C in ``--cp`` (1 included), C gloo ranks build ``--layers``
    transformer layers (GPT-2 style, bf16, no dropout) with a real CP group and run one
    micro-batch through them, each rank its s/C tokens in the chunk layout; saved-tensor
    hooks sum the distinct storages autograd keeps for backward (attention included;
    parameters and buffers left out, ``accounting.activations.saved_bytes``). Per comm type:
    the ratio to C = 1 against the target 1.05 x (1/C), and the accounting's prediction
    (``layer_activation_bytes`` at C);
(b) causal balance: the query-key pairs the causal mask lets through on each rank, counted
    by brute force over ``cp.layout.rank_index`` (index_j <= index_i), max / min against the
    target 1.05; contiguous shards beside it;
(c) step time at CP=2 against DP=2 at equal tokens per step (2 ranks each, the same global
    batch): DP ranks take half the samples, whole; CP ranks every sample, half of each. Two
    levels: ``--layers`` transformer layers forward and backward plus the gradient
    all-reduce over the 2 ranks (always), and the real trainer (``build_trainer``,
    ``--context-parallel-size 2``) when it runs context parallelism. The runs alternate in
    rotating order, each timed from a barrier; a step's time is the slower rank's, the
    table shows medians; target CP2 <= 1.15 x DP2;
(d) PyTorch's own ``torch.distributed.tensor.experimental.context_parallel`` on the same
    attention, tried on the CPU with gloo: its time, or the exact reason it does not run.

Everything runs on the CPU with one thread per rank; the timings are indicative only (and
say so when other work shares the machine), byte counts do not depend on the machine.

    python -m benchmarks.context_parallel
    python -m benchmarks.context_parallel --seq 2048 --cp 1 2 4 --steps 10
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence

import torch

from benchmarks.common import add_model_args, spawn
from benchmarks.context_parallel_runs import (
    COMM_TYPES,
    layer_saved_bytes,
    time_layers,
    time_trainers,
    torch_context_parallel,
)
from megatron3d.accounting.activations import layer_activation_bytes
from megatron3d.accounting.context_parallel import causal_pairs, imbalance
from megatron3d.config import ModelConfig
from megatron3d.cp.layout import rank_index

TARGET_MEMORY = 1.05  # CP=C keeps at most 1.05 x (1/C) of CP=1's activation bytes
TARGET_BALANCE = 1.05  # max / min attention FLOPs over CP ranks
TARGET_STEP = 1.15  # CP=2 step time over DP=2's
DTYPE = torch.bfloat16


def model_config(a: argparse.Namespace) -> ModelConfig:
    """The benchmark's model: GPT-2 style, no dropout (the CP exchanges compute the same
    function as one process only without it)."""
    return ModelConfig(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads,
                       seq_length=a.seq, vocab_size=a.vocab, hidden_dropout=0.0,
                       attention_dropout=0.0)


def brute_force_pairs(seq: int, cp: int) -> list[int]:
    """Visible query-key pairs per rank, counted over the real layout's token indices."""
    keys = torch.arange(seq)
    return [int((rank_index(seq, cp, r).unsqueeze(1) >= keys).sum()) for r in range(cp)]


def balance_rows(seq: int, cps: Sequence[int]) -> list[str]:
    """(b): per C, the chunk layout's max/min (brute force, and the accounting's formula must
    agree) and contiguous shards'."""
    rows = [f"  {'C':>2}{'pairs/rank (min..max)':>26}{'max/min':>9}{'target':>8}"
            f"{'contiguous max/min':>20}"]
    for c in cps:
        pairs = brute_force_pairs(seq, c)
        if pairs != causal_pairs(seq, c):
            raise AssertionError(f"C={c}: accounting {causal_pairs(seq, c)} != layout {pairs}")
        verdict = "ok" if imbalance(pairs) <= TARGET_BALANCE else "MISSED"
        rows.append(f"  {c:>2}{f'{min(pairs):,}..{max(pairs):,}':>26}{imbalance(pairs):>9.3f}"
                    f"{f'<= {TARGET_BALANCE}':>8} {verdict:<4}"
                    f"{imbalance(causal_pairs(seq, c, balanced=False)):>15.3f}")
    return rows


def memory_rows(cfg: ModelConfig, micro_batch: int, measured: dict[tuple[int, str], int]
                ) -> list[str]:
    """(a): one row per (C, comm type): measured bytes per layer and rank, the ratio to
    C = 1's, the bound 1.05 / C, and the accounting's prediction."""
    base = measured[(1, COMM_TYPES[0])]
    rows = [f"  {'C':>2} {'comm':<11}{'measured B':>13}{'ratio':>8}{'bound':>8}"
            f"{'predicted B':>13}{'m/pred':>8}"]
    for (c, comm), size in sorted(measured.items()):
        if c == 1 and comm != COMM_TYPES[0]:
            continue
        predicted = sum(layer_activation_bytes(cfg, micro_batch, 1, False, DTYPE, "cpu", c,
                                               comm).values())
        ratio, bound = size / base, TARGET_MEMORY / c
        verdict = "" if c == 1 else ("ok" if ratio <= bound else "MISSED")
        rows.append(f"  {c:>2} {comm if c > 1 else '-':<11}{size:>13,}{ratio:>8.3f}"
                    f"{bound:>8.3f}{predicted:>13,}{size / predicted:>8.3f} {verdict}")
    return rows


def median_ms(per_rank: Sequence[dict[str, list[float]]], name: str) -> float:
    """Median over the timed steps of the slower rank's time, in ms."""
    steps = zip(*(rank[name] for rank in per_rank), strict=True)
    return statistics.median(max(ranks) for ranks in steps) * 1e3


def step_rows(per_rank: Sequence[dict[str, list[float]]], baseline: str) -> list[str]:
    """(c): every run's median step time and its ratio to ``baseline`` (DP=2)."""
    base = median_ms(per_rank, baseline)
    rows = []
    for name in per_rank[0]:
        ms = median_ms(per_rank, name)
        verdict = "" if name == baseline else (
            "ok" if ms / base <= TARGET_STEP else "MISSED")
        rows.append(f"  {name:<22}{ms:>10.2f} ms{ms / base:>8.3f} x DP=2 {verdict}")
    return rows


def _args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p, layers=2, hidden=256, heads=8, seq=1024, micro_batch=2, vocab=1024)
    p.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--steps", type=int, default=8, help="Timed steps of each run.")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--skip-trainer", action="store_true",
                   help="Time the layers only, not the real trainer.")
    a = p.parse_args(argv)
    if 1 not in a.cp:
        a.cp = [1, *a.cp]
    return a


def main(argv: Sequence[str] | None = None) -> None:
    a = _args(argv)
    start, out = time.perf_counter(), sys.stdout
    cfg = model_config(a)
    out.write(f"model: {a.layers} layers, hidden={a.hidden} heads={a.heads} seq={a.seq} "
              f"micro-batch={a.micro_batch}, bf16, LayerNorm, GeLU 4h, no dropout\n")
    measured = {}
    for c in a.cp:
        for comm in COMM_TYPES if c > 1 else COMM_TYPES[:1]:
            ranks = spawn(layer_saved_bytes, c, a, c, comm)
            if any(r != ranks[0] for r in ranks):
                out.write(f"  C={c} {comm}: ranks differ {ranks}\n")
            measured[(c, comm)] = max(max(r) for r in ranks)
    out.write("(a) bytes one layer keeps for backward, per rank (the largest layer and rank)\n")
    out.write("\n".join(memory_rows(cfg, a.micro_batch, measured)) + "\n")
    out.write(f"(b) causal attention work per CP rank at s={a.seq}\n")
    out.write("\n".join(balance_rows(a.seq, [c for c in a.cp if c > 1])) + "\n")
    layers = spawn(time_layers, 2, a)
    out.write(f"(c) step time, 2 ranks, equal tokens per step; machine: {layers[0][0]}\n")
    out.write(f"  {a.layers} layers forward + backward + gradient all-reduce:\n")
    out.write("\n".join(step_rows([r[1] for r in layers], "DP=2")) + "\n")
    if not a.skip_trainer:
        trainers = spawn(time_trainers, 2, a)
        if isinstance(trainers[0], str):
            out.write(f"  the trainer: not run: {trainers[0]}\n")
        else:
            out.write("  the trainer (build_trainer, whole steps):\n")
            out.write("\n".join(step_rows(trainers, "DP=2")) + "\n")
    torch_rows = spawn(torch_context_parallel, 2, a)
    out.write(f"(d) torch context_parallel, attention forward + backward: {torch_rows[0]}\n")
    out.write(f"wall time: {time.perf_counter() - start:.1f} s\n")


if __name__ == "__main__":
    main()
