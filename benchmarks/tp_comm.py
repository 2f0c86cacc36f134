"""How many bytes does tensor parallelism communicate per micro-batch, against Megatron's count?

Megatron's analysis (Narayanan et al. 2021) says each transformer block all-reduces its
[s, b, h] activation twice in forward (after attention and after the MLP) and twice in
backward (the input gradients of the QKV and first MLP projections): 4 * L * b * s * h
elements per micro-batch per TP rank. Everything else is counted on its own line: the
vocab-parallel embedding sums its partial lookups (forward), the LM head all-reduces its
input gradient (backward), and vocab-parallel cross entropy reduces three [s, b] tensors
(row max, target logit, sum of exponentials). With sequence parallelism each all-reduce
becomes a reduce-scatter plus an all-gather moving the same volume over a ring, backward
all-gathers again the input shard each column-parallel linear kept (Megatron's way of not
keeping the gathered input), and the sequence-sharded norm and bias gradients are
all-reduced once per step.

Each TP rank is a gloo process on the CPU (the byte counts do not depend on the device). A
``CommCounter`` observes every collective from before the model is built; forward runs
layer by layer and gradient hooks on each layer's output mark where backward is, so each
collective is filed under the layer that issued it. Bytes are what each rank contributes
(its input tensor); "wire" estimates what a ring algorithm sends per rank.

    python -m benchmarks.tp_comm
    python -m benchmarks.tp_comm --layers 8 --hidden 512 --tp 2 4 8
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from collections.abc import Callable

import torch

from benchmarks.common import add_model_args, spawn
from megatron3d import device as devices
from megatron3d.config import ModelConfig
from megatron3d.data.mock import MockGPTDataset
from megatron3d.data.sampler import micro_batches
from megatron3d.model.context import LayerContext
from megatron3d.model.gpt import build_gpt, lm_loss
from megatron3d.mpu import comm, traffic
from megatron3d.mpu.meta import get_meta
from megatron3d.mpu.random import RNGStreams
from megatron3d.mpu.state import ParallelState

BLOCKS, EMBED, HEAD, LOSS, SYNC = ("transformer blocks", "embedding", "LM head",
                                   "cross-entropy", "SP grad sync")
PARTS = {"InputEmbedding": EMBED, "InputNorm": "embedding norm", "TransformerLayer": BLOCKS,
         "FinalNorm": "final norm", "OutputEmbedding": HEAD}
NOTES = {
    BLOCKS: "attention out + MLP out (fwd), QKV + MLP-in input grads (bwd)",
    EMBED: "vocab-parallel lookup: partial rows summed over TP",
    HEAD: "the LM head's replicated input (its gradient, or SP's gather)",
    LOSS: "row max, target logit, sum of exps: [s, b] each",
    SYNC: "sequence-sharded norm/bias/position grads, once per step",
}
PASSES = ("fwd", "bwd", "step")
Key = tuple[str, str, str]  # (part, pass, collective kind)
Tally = dict[Key, tuple[int, int]]  # -> (calls, bytes)
FP32_BYTES = 4


class PhaseCounter(traffic.CommCounter):
    """A CommCounter that also files every collective under the phase the driver last set."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = ("build", "-")
        self.tally: defaultdict[Key, list[int]] = defaultdict(lambda: [0, 0])

    def __call__(self, kind: str, tensor: torch.Tensor, *where: object) -> None:
        super().__call__(kind, tensor, *where)
        entry = self.tally[(*self.phase, kind)]
        entry[0] += 1
        entry[1] += tensor.numel() * tensor.element_size()


def _enter(counter: PhaseCounter, phase: tuple[str, str]) -> Callable[[torch.Tensor], None]:
    """A gradient hook: backward reaches this tensor, so what follows belongs to ``phase``."""
    def hook(_: torch.Tensor) -> None:
        counter.phase = phase
    return hook


def _model_config(a: argparse.Namespace) -> ModelConfig:
    return ModelConfig(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads,
                       seq_length=a.seq, vocab_size=a.vocab, hidden_dropout=0.0,
                       attention_dropout=0.0)


def _one_micro_batch(a: argparse.Namespace, sequence_parallel: bool) -> Tally:
    """Build the model on a counted state, run one forward+backward, and the SP grad sync."""
    counter = PhaseCounter()
    with traffic.observing(counter):  # attached before the model exists
        return _count(a, sequence_parallel, counter)


def _count(a: argparse.Namespace, sequence_parallel: bool, counter: PhaseCounter) -> Tally:
    state = ParallelState.build(a.tp_size, 1)
    dev = torch.device("cpu")
    rng = RNGStreams.create(a.seed, state.tp.rank, state.pp.rank, dev)
    ctx = LayerContext(_model_config(a), state.tp, a.seed, torch.float32, dev, rng,
                       sequence_parallel=sequence_parallel)
    model = build_gpt(ctx)
    model.train()
    data = MockGPTDataset(a.vocab, a.seq, a.seed)
    batch = micro_batches(data, 0, a.micro_batch, a.micro_batch, 0, 1, dev)[0]
    x = batch.tokens  # [b, s]
    for layer in model.layers:
        part = PARTS[type(layer).__name__]
        counter.phase = (part, "fwd")
        x = layer(x)
        x.register_hook(_enter(counter, (part, "bwd")))
    counter.phase = (LOSS, "fwd")
    loss = lm_loss(x, batch.labels, batch.loss_mask, ctx)
    loss.register_hook(_enter(counter, (LOSS, "bwd")))
    loss.backward()
    counter.phase = (SYNC, "step")  # what the trainer's grad_sync does before the optimizer
    comm.all_reduce_coalesced([p.grad for p in model.parameters()
                               if get_meta(p).sequence_parallel], state.tp)
    return {key: (calls, size) for key, (calls, size) in counter.tally.items()}


def _measure(a: argparse.Namespace) -> tuple[str, Tally, Tally]:
    """One TP rank: the machine, then the tallies without and with sequence parallelism."""
    return (devices.describe(torch.device("cpu")), _one_micro_batch(a, False),
            _one_micro_batch(a, True))


def analytic(a: argparse.Namespace, k: int, sequence_parallel: bool) -> dict[Key, int]:
    """Bytes each TP rank contributes per collective, from the shapes alone (fp32)."""
    bsh = a.micro_batch * a.seq * a.hidden * FP32_BYTES  # one [s, b, h] activation
    layers = a.layers
    out = {(LOSS, "fwd", "all_reduce"): 3 * a.micro_batch * a.seq * FP32_BYTES}
    if not sequence_parallel:
        out.update({(BLOCKS, "fwd", "all_reduce"): 2 * layers * bsh,
                    (BLOCKS, "bwd", "all_reduce"): 2 * layers * bsh,
                    (EMBED, "fwd", "all_reduce"): bsh, (HEAD, "bwd", "all_reduce"): bsh})
        return out
    # An all-gather contributes its [s/k, b, h] shard, a reduce-scatter the full [s, b, h].
    # Backward re-gathers the [s/k, b, h] input shard each column-parallel linear kept (the
    # QKV and first MLP projections, and the LM head), as Megatron does under SP.
    for part, pass_, gathers, scatters in ((BLOCKS, "fwd", 2 * layers, 2 * layers),
                                          (BLOCKS, "bwd", 4 * layers, 2 * layers),
                                          (EMBED, "fwd", 0, 1), (EMBED, "bwd", 1, 0),
                                          (HEAD, "fwd", 1, 0), (HEAD, "bwd", 1, 1)):
        if gathers:
            out[(part, pass_, "all_gather")] = gathers * bsh // k
        if scatters:
            out[(part, pass_, "reduce_scatter")] = scatters * bsh
    # Replicated parameters applied to sequence shards: per layer two LayerNorms (weight and
    # bias) and the biases of the two row-parallel projections, the final LayerNorm, positions.
    numel = (layers * (2 * 2 + 2) + 2) * a.hidden + a.seq * a.hidden
    out[(SYNC, "step", "all_reduce")] = numel * FP32_BYTES
    return out


def wire_bytes(kind: str, contributed: int, k: int) -> float:
    """What one rank sends in a ring algorithm for a collective it contributes bytes to."""
    factor = {"all_reduce": 2 * (k - 1) / k, "reduce_scatter": (k - 1) / k,
              "all_gather": float(k - 1)}
    return contributed * factor[kind]


def _row(label: str, pass_: str, kind: str, calls: int | str, measured: int,
         expected: int | None, note: str = "") -> str:
    ratio = f"{measured / expected:.3f}" if expected else "-"
    shown = "-" if expected is None else f"{expected:,}"
    return (f"  {label:<20}{pass_:<6}{kind:<16}{calls!s:>5}{measured:>13,}{shown:>13}"
            f"{ratio:>8}  {note}".rstrip())


def _order(key: Key) -> tuple:
    part, pass_, kind = key
    return (list(NOTES).index(part) if part in NOTES else len(NOTES), part,
            PASSES.index(pass_) if pass_ in PASSES else len(PASSES), kind)


def _table(a: argparse.Namespace, k: int, sp: bool, tally: Tally) -> list[str]:
    """Measured vs analytic per (part, pass, kind), the block subtotal, and the total."""
    expected = analytic(a, k, sp)
    lines = [f"  {'part':<20}{'pass':<6}{'collective':<16}{'calls':>5}{'measured B':>13}"
             f"{'analytic B':>13}{'ratio':>8}"]
    noted: set[str] = set()
    for key in sorted(set(tally) | set(expected), key=_order):
        calls, size = tally.get(key, (0, 0))
        note = "(not in the analytic model)" if key not in expected else (
            "" if key[0] in noted else NOTES.get(key[0], ""))
        noted.add(key[0])
        lines.append(_row(*key, calls, size, expected.get(key), note))
    blocks = [key for key in set(tally) | set(expected) if key[0] == BLOCKS]
    formula = ("4*L*b*s*h elements x 4 B, Megatron's count" if not sp else
               "per layer: fwd 2 AG + 2 RS, bwd 4 AG (2 re-gathers) + 2 RS")
    lines.append(_row(BLOCKS, "both", "all kinds", sum(tally.get(b, (0, 0))[0] for b in blocks),
                      sum(tally.get(b, (0, 0))[1] for b in blocks),
                      sum(expected.get(b, 0) for b in blocks), f"<- {formula}"))
    lines.append(_row("total", "", "", sum(c for c, _ in tally.values()),
                      sum(s for _, s in tally.values()), sum(expected.values())))
    return lines


def _block_wire(tally: Tally, k: int) -> float:
    return sum(wire_bytes(kind, size, k) for (part, _, kind), (_, size) in tally.items()
               if part == BLOCKS)


def _report(a: argparse.Namespace, k: int, per_rank: list[tuple[str, Tally, Tally]]) -> str:
    _, tp_tally, sp_tally = per_rank[0]
    same = all(r[1:] == per_rank[0][1:] for r in per_rank)
    lines = []
    for sp, tally in ((False, tp_tally), (True, sp_tally)):
        lines.append(f"TP={k}, sequence parallel {'on' if sp else 'off'}: bytes per TP rank "
                     "(rank 0; identical on every rank: " + ("yes" if same else "NO") + ")")
        lines += _table(a, k, sp, tally)
    tp_wire, sp_wire = _block_wire(tp_tally, k), _block_wire(sp_tally, k)
    model = {sp: _block_wire({key: (0, size) for key, size in analytic(a, k, sp).items()}, k)
             for sp in (False, True)}
    lines.append(f"TP={k} blocks, estimated ring wire bytes per rank (from the measured bytes): "
                 f"TP all-reduce {tp_wire:,.0f}, SP all-gather + reduce-scatter "
                 f"{sp_wire:,.0f}; SP/TP = {sp_wire / tp_wire:.3f} (analytic "
                 f"{model[True] / model[False]:.3f}: the backward re-gathers of SP)")
    return "\n".join(lines)


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p)
    p.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args()


def main() -> None:
    a = _args()
    start = time.perf_counter()
    cfg = _model_config(a)
    out = sys.stdout
    elements = 4 * a.layers * a.micro_batch * a.seq * a.hidden
    out.write(f"model: GPT layers={a.layers} hidden={a.hidden} heads={a.heads} seq={a.seq} "
              f"micro-batch={a.micro_batch} vocab={a.vocab} fp32, dropout 0; "
              "one forward+backward of one micro-batch\n"
              f"Megatron's block all-reduces per TP rank: 4*L*b*s*h = 4*{a.layers}*"
              f"{a.micro_batch}*{a.seq}*{a.hidden} = {elements:,} elements = "
              f"{elements * FP32_BYTES:,} B in fp32\n")
    for k in a.tp:
        a.tp_size = k
        per_rank = spawn(_measure, k, a)
        if k == a.tp[0]:
            out.write(f"machine (each TP rank, gloo on CPU): {per_rank[0][0]}\n")
        out.write(f"padded vocab at TP={k}: {cfg.padded_vocab_size(k)}\n")
        out.write(_report(a, k, per_rank) + "\n")
        out.flush()
    out.write(f"wall time: {time.perf_counter() - start:.1f} s\n")


if __name__ == "__main__":
    main()
