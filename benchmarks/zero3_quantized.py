"""Does ZeRO-3 with int8 collectives train as well as fp32? Issue #34's target: the loss after
300 steps within 1% of fp32's, on the quickstart corpus, with the weight error bounded.

The quickstart's model and corpus (``scripts/quickstart.sh``: the standard library's source,
its SentencePiece tokenizer, prepared by the repository's own tools into
``runs/quickstart/data`` when missing), trained for ``--iters`` (300) steps with ZeRO-3 on 4
gloo ranks as 2 "nodes" x 2 (``--gpus-per-node 2``), TP = PP = 1, in these ways:

- flat ZeRO-3, fp32 collectives (the reference);
- flat ZeRO-3 with ``--zero3-quantize-weights --zero3-quantize-grads``;
- the same two under ``--zero3-secondary-shard node``.

Each run's final loss is the mean of its last 10 steps; a quantized run's relative difference
to the fp32 run of its mode is checked against the 1% target. Whether a run really used what
its flags ask is read from its collectives (``mpu.traffic``): int8 bytes on the wire for the
quantization, collectives on the inter-node axis for the secondary shard. A run whose flags
the runtime does not act on yet stops after its first step and shows "not wired".

The weight error: every final weight of the quantized run, cut into blocks of 256, through
``zero/quantize``'s int8 round trip (the tests show the collectives give exactly these
values): the largest error and the largest ratio to the stated per-element bound (<= 1).

    python -m benchmarks.zero3_quantized            # ~4 x 300 steps on 4 ranks
    python -m benchmarks.zero3_quantized --iters 40  # a quick look
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import spawn
from megatron3d.cli.arguments import parse_args
from megatron3d.mpu.state import ParallelState
from megatron3d.training.build import Overrides, build_trainer
from megatron3d.training.loop import Hooks
from megatron3d.validation import validate
from megatron3d.zero import quantize

TARGET = 0.01  # relative loss difference after 300 steps
LAST = 10  # steps averaged into the final loss
CORPUS = ["--max-mb", "4", "--seed", "1234"]  # scripts/quickstart.sh's
QUANTIZED = ("--zero3-quantize-weights", "--zero3-quantize-grads")
MODES = {"flat": (), "secondary shard": ("--zero3-secondary-shard", "node")}


def prepare(data: Path) -> Path:
    """The quickstart's corpus, tokenizer and indexed data, built as it builds them; returns
    the data prefix."""
    stamp = data / "corpus.flags"
    if not stamp.exists() or stamp.read_text().strip() != " ".join(CORPUS):
        data.mkdir(parents=True, exist_ok=True)
        tool = [sys.executable]
        subprocess.run([*tool, "tools/stdlib_corpus.py", "--output", f"{data}/stdlib.jsonl",
                        *CORPUS], check=True)
        subprocess.run([*tool, "tools/train_tokenizer.py", "--input", f"{data}/stdlib.jsonl",
                        "--model-prefix", f"{data}/stdlib_sp", "--vocab-size", "2048"],
                       check=True)
        subprocess.run([*tool, "tools/preprocess_data.py", "--input", f"{data}/stdlib.jsonl",
                        "--output-prefix", f"{data}/stdlib", "--json-keys", "text",
                        "--append-eod", "--workers", "2", "--tokenizer-type",
                        "SentencePieceTokenizer", "--tokenizer-model",
                        f"{data}/stdlib_sp.model"], check=True)
        stamp.write_text(" ".join(CORPUS) + "\n")
    return data / "stdlib_text_document"


def argv(data: Path, iters: int, extra: tuple[str, ...]) -> list[str]:
    """The quickstart's model, schedule and data as ZeRO-3 on 4 ranks, 2 per node."""
    return ["--zero-stage", "3", "--gpus-per-node", "2",
            "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "64", "--max-position-embeddings", "64",
            "--micro-batch-size", "4", "--global-batch-size", "32",
            "--train-iters", str(iters), "--lr", "3e-3", "--min-lr", "3e-4",
            "--lr-decay-style", "cosine", "--lr-warmup-fraction", "0.08",
            "--weight-decay", "0.1", "--clip-grad", "1.0", "--hidden-dropout", "0.0",
            "--attention-dropout", "0.0", "--data-path", str(data), "--split", "969,30,1",
            "--tokenizer-type", "SentencePieceTokenizer",
            "--tokenizer-model", str(data.parent / "stdlib_sp.model"),
            "--seed", "1234", "--log-interval", "1000", "--eval-interval", "1000000",
            "--eval-iters", "0", *extra]


class _Seen:
    """Observer of ``mpu.comm``: which axes and wire dtypes the run's collectives used."""

    def __init__(self) -> None:
        self.axes: set[str] = set()
        self.int8 = False

    def __call__(self, kind: str, tensor: torch.Tensor, axis: object, peer: object = None,
                 tag: object = None) -> None:
        self.axes.add(getattr(axis, "name", ""))
        self.int8 |= tensor.dtype in (torch.uint8, torch.int8)


class _NotWiredError(Exception):
    """The runtime does not act on a flag of this run yet."""


def _ranks(runs: list[tuple[list[str], bool, bool]]) -> list[dict]:
    """This rank's part of every run, one after the other in the same processes (one
    start-up for all)."""
    return [_rank(*run) for run in runs]


def _rank(args: list[str], wants_int8: bool, wants_inter: bool) -> dict:
    """One rank's run: its per-step losses and final weights' error, or "not wired"."""
    from megatron3d.mpu import traffic

    cfg = parse_args(args)
    validate(cfg, torch.distributed.get_world_size())
    state = ParallelState.for_config(cfg.parallel)
    seen, losses = _Seen(), []

    def on_step(it: int, result: object) -> None:
        losses.append(result.loss.detach().clone())
        missing = [name for name, wanted, got in (
            ("int8 collectives", wants_int8, seen.int8),
            ("collectives on the inter-node axis", wants_inter, "dp_inter" in seen.axes))
            if wanted and not got]
        if it == 1 and missing:
            raise _NotWiredError(", ".join(missing))

    trainer = build_trainer(cfg, state, torch.device("cpu"),
                            overrides=Overrides(hooks=Hooks(on_step=on_step)))
    start = time.perf_counter()
    try:
        with traffic.observing(seen):
            trainer.run()
    except _NotWiredError as missing:
        return {"not wired": str(missing)}
    weights: list[torch.Tensor] = []
    trainer.model.data_parallel.materialize(
        lambda group: weights.extend(p.detach().reshape(-1).clone() for p in group))
    return {"losses": [x.item() for x in losses], "seconds": time.perf_counter() - start,
            "weight error": weight_error(weights)}


def weight_error(weights: list[torch.Tensor]) -> tuple[float, float]:
    """(largest |w - int8 round trip of w|, largest error / stated bound) over the weights."""
    worst, ratio = 0.0, 0.0
    for w in weights:
        q, scales = quantize.quantize(w)
        err = (w - quantize.dequantize(q, scales, torch.empty_like(w))).abs()
        bound = scales.repeat_interleave(256)[:w.numel()] * 127 / 254
        worst = max(worst, err.max().item())
        ratio = max(ratio, (err / bound.clamp_min(1e-30)).max().item())
    return worst, ratio


def main(argv_: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--data", type=Path, default=Path("runs/quickstart/data"))
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    a = p.parse_args(argv_)
    data = prepare(a.data)
    runs = [(mode, label, argv(data, a.iters, (*MODES[mode], *flags)), bool(flags),
             mode != "flat")
            for mode in a.modes for label, flags in (("fp32", ()), ("int8", QUANTIZED))]
    began = time.perf_counter()
    results = spawn(_ranks, 4, [run[2:] for run in runs], timeout_s=3600)[0]
    out = []
    for mode in a.modes:
        out += _report(mode, {label: result for (m, label, *_), result
                              in zip(runs, results, strict=True) if m == mode})
    out.append(f"{time.perf_counter() - began:.0f} s in all, start-up included")
    sys.stdout.write("\n".join(out) + "\n")
    return 0


def _report(mode: str, runs: dict[str, dict]) -> list[str]:
    lines = [f"{mode}:"]
    final = {}
    for label, run in runs.items():
        if "not wired" in run:
            lines.append(f"  {label:<5} not wired: its first step issued no {run['not wired']}")
            continue
        final[label] = statistics.fmean(run["losses"][-LAST:])
        lines.append(f"  {label:<5} final loss {final[label]:.4f} (mean of the last {LAST} of "
                     f"{len(run['losses'])} steps), {run['seconds']:.0f} s training")
    if len(final) == 2:
        rel = abs(final["int8"] - final["fp32"]) / final["fp32"]
        verdict = "met" if rel <= TARGET else "MISSED"
        worst, ratio = runs["int8"]["weight error"]
        lines += [f"  relative loss difference {rel:.4%} (target <= {TARGET:.0%}: {verdict})",
                  f"  weight error: max {worst:.3g}, at most {ratio:.3f} of the stated bound "
                  "(block absmax / 254)"]
    return lines


if __name__ == "__main__":
    sys.exit(main())
