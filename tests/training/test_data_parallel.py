"""Data parallelism and ZeRO-1 (also with overlapped parameter gathers) across TP x PP x DP
train the same model as one process: per-step losses, grad norms and final parameters, with
clipping and a batch-size rampup."""

from __future__ import annotations

import pytest

from tests.helpers.dist import run_distributed
from tests.helpers.runs import assert_each_variant, reference_run, train
from tests.helpers.tiny import ramp_argv
from tests.helpers.tolerances import EQUIVALENCE_FLAGS, FP32

# The global batch ramps over at least two increments in the first steps: 4 -> 8 -> 12 -> 16
# for DP 2, and 8 -> 16 -> 24 for DP 4 (every size divisible by micro-batch 2 x DP). A small
# clip keeps clipping active on every step.
COMMON = ("--clip-grad", "0.05", *EQUIVALENCE_FLAGS)
RAMPS = {2: ("16", "4", "4", "48"), 4: ("24", "8", "8", "32")}  # G, START, INCR, SAMPLES
STEPS = 10
# A small bucket size gives several buckets, so overlapped reductions and ZeRO slices of
# many buckets are exercised.
BUCKETS = ("--reduce-bucket-size", "2000")


def _argv(flavour: str, ramp: tuple[str, ...], *extra: str) -> list[str]:
    return ramp_argv(flavour, STEPS, ramp, *COMMON, *extra)


VARIANTS = {"ZeRO-0": ("--zero-stage", "0"), "ZeRO-1": ("--zero-stage", "1"),
            "ZeRO-1 overlapped gather": ("--zero-stage", "1", "--overlap-param-gather")}


def _layout_runs(tp: int, pp: int, flavour: str, ramp: tuple[str, ...]) -> list:
    """One rank: every variant in the same processes."""
    layout = ("--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size",
              str(pp), "--pp-partition-method", "uniform", *BUCKETS)
    return [train(_argv(flavour, ramp, *layout, *flags)) for flags in VARIANTS.values()]


LAYOUTS = [  # (tp, pp, dp, flavour)
    (1, 1, 2, "gpt2"), (1, 1, 4, "llama"), (2, 1, 2, "bloom"), (1, 2, 2, "gpt2"),
    (2, 2, 2, "bloom"),
]


@pytest.mark.parametrize(("tp", "pp", "dp", "flavour"), LAYOUTS,
                         ids=[f"tp{t}-pp{p}-dp{d}" for t, p, d, _ in LAYOUTS])
def test_dp_and_zero1_match_single_process(tp, pp, dp, flavour):
    ramp = RAMPS[dp]
    per_rank = run_distributed(_layout_runs, tp * pp * dp, tp, pp, flavour, ramp,
                               timeout_s=300)
    reference = reference_run(tuple(_argv(flavour, ramp)))
    assert_each_variant(per_rank, reference, [f"{variant}, TP={tp} PP={pp} DP={dp}"
                                              for variant in VARIANTS], FP32)
