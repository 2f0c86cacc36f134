"""ZeRO-3 across TP x PP x DP trains the same model as one process: per-step losses, grad
norms and final parameters, with >= 4 micro-batches per step, clipping active and a rampup
across two increments, over every fetch option (prefetch depth 0/1/2, all-gather and
all-reduce fetch, reshard after forward or not, with and without recompute, and sequence
parallelism)."""

from __future__ import annotations

import pytest

from tests.helpers.dist import run_distributed
from tests.helpers.runs import assert_each_variant, reference_run, train
from tests.helpers.tiny import ramp_argv
from tests.helpers.tolerances import EQUIVALENCE_FLAGS, FP32

# Micro-batch 1: the global batch ramps 8 -> 12 -> 16 (DP 2) or 16 -> 24 -> 32 (DP 4), so
# every step has at least 4 micro-batches per rank. A small clip keeps clipping active.
COMMON = ("--clip-grad", "0.05", "--micro-batch-size", "1", *EQUIVALENCE_FLAGS)
RAMPS = {2: ("16", "8", "4", "32"), 4: ("32", "16", "8", "32")}  # G, START, INCR, SAMPLES
STEPS = 6  # enough to cover the ramp (3 steps) and several Adam updates

DEPTH0 = ("--zero3-prefetch-depth", "0")
DEPTH2 = ("--zero3-prefetch-depth", "2")
ALLREDUCE = ("--zero3-allreduce-fetch",)
KEEP = ("--zero3-reshard-after-forward", "false")
RECOMPUTE = ("--checkpoint-activations",)

# (tp, pp, dp, flavour, variants): each variant is one run; together they cover every
# option on every layout kind (DP only, TP, PP, all three) and both flavours.
LAYOUTS = [
    (1, 1, 2, "gpt2", [DEPTH0, (*ALLREDUCE,), (*DEPTH2, *KEEP, *RECOMPUTE)]),
    (1, 1, 4, "llama", [(), (*DEPTH2, *ALLREDUCE, *RECOMPUTE)]),
    (2, 1, 2, "llama", [(*DEPTH0, *KEEP), (*ALLREDUCE, *RECOMPUTE)]),
    (1, 2, 2, "gpt2", [(), (*DEPTH2, *KEEP), (*DEPTH0, *ALLREDUCE, *RECOMPUTE)]),
    (2, 2, 2, "gpt2", [(*RECOMPUTE,), (*DEPTH2, *ALLREDUCE, *KEEP)]),
    (2, 2, 2, "llama", [(*DEPTH0,), (*DEPTH2, *RECOMPUTE, "--sequence-parallel")]),
]


def _argv(flavour: str, ramp: tuple[str, ...], *extra: str) -> list[str]:
    return ramp_argv(flavour, STEPS, ramp, *COMMON, *extra)


def _runs(tp: int, pp: int, flavour: str, ramp: tuple[str, ...], variants: list) -> list:
    layout = ("--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size",
              str(pp), "--pp-partition-method", "uniform", "--zero-stage", "3")
    return [train(_argv(flavour, ramp, *layout, *variant)) for variant in variants]


@pytest.mark.parametrize(("tp", "pp", "dp", "flavour", "variants"), LAYOUTS,
                         ids=[f"tp{t}-pp{p}-dp{d}-{f}" for t, p, d, f, _ in LAYOUTS])
def test_zero3_matches_single_process(tp, pp, dp, flavour, variants):
    ramp = RAMPS[dp]
    per_rank = run_distributed(_runs, tp * pp * dp, tp, pp, flavour, ramp, variants,
                               timeout_s=400)
    reference = reference_run(tuple(_argv(flavour, ramp)))
    assert_each_variant(per_rank, reference, [f"ZeRO-3 {variant}, TP={tp} PP={pp} DP={dp}"
                                              for variant in variants], FP32)
