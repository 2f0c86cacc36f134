"""Context parallelism trains the same model as one process (fp32, rtol 1e-5: per-step
losses, grad norms, the evaluation loss and the final parameters): CP 2 for GPT-2 (learned
positions), BLOOM (ALiBi, embedding norm) and Llama (RoPE, GQA, SwiGLU, RMSNorm) with every
exchange, CP 4 (with ZeRO-1), and CP 2 with TP 2 (sequence parallel), PP 2, ZeRO-3 (over
dp x cp) with DP 2 and interleaved 1F1B. One spawn per world size runs all of its cases."""

from __future__ import annotations

from tests.helpers.dist import run_distributed
from tests.helpers.runs import assert_same_run, merge_ranks, reference_run, train
from tests.helpers.tiny import train_argv
from tests.helpers.tolerances import EQUIVALENCE_FLAGS, FP32

STEPS = 3
COMMON = ("--clip-grad", "0.5", *EQUIVALENCE_FLAGS)
MODEL = {"gpt2": (), "bloom": (),  # Llama with two key/value groups for four query heads
         "llama": ("--group-query-attention", "--num-query-groups", "2")}
Case = tuple[str, tuple[str, ...], tuple[str, ...]]  # flavour, model flags, layout flags


def _argv(flavour: str, model: tuple[str, ...], *layout: str) -> list[str]:
    return train_argv(flavour, STEPS, *COMMON, *MODEL[flavour], *model, *layout)


def _cp(size: int, comm: str, *extra: str) -> tuple[str, ...]:
    return ("--context-parallel-size", str(size), "--cp-comm-type", comm, *extra)


def _runs(cases: list[Case]) -> list:
    """One rank: every case in turn (one spawn serves them all)."""
    return [train(_argv(flavour, model, *layout)) for flavour, model, layout in cases]


def _check(world: int, cases: list[Case]) -> None:
    per_rank = run_distributed(_runs, world, cases, timeout_s=300)
    for i, (flavour, model, layout) in enumerate(cases):
        merged = merge_ranks([results[i] for results in per_rank])
        reference = reference_run(tuple(_argv(flavour, model)))
        try:
            assert_same_run(merged, reference, FP32)
        except AssertionError as err:
            raise AssertionError(f"{flavour} {' '.join(layout)}: {err}") from err


# The global batch ramps 4 -> 8 over the first steps (micro-batches of 2: 2, then 4 of them).
RAMP = ("--rampup-batch-size", "4", "4", "8")


def test_cp2_matches_one_process_for_every_flavour_and_exchange():
    """And with full or selective recompute (the re-run sees its micro-batch's tokens) and a
    batch-size rampup."""
    _check(2, [(flavour, (), _cp(2, comm)) for flavour in MODEL
               for comm in ("p2p", "all_gather", "a2a")]
           + [("gpt2", ("--recompute-granularity", "full", *RAMP), _cp(2, "p2p")),
              ("llama", ("--recompute-granularity", "selective"), _cp(2, "a2a"))])


LAYERS4 = ("--num-layers", "4")
UNIFORM = ("--pp-partition-method", "uniform")
TP2_SP = ("--tensor-model-parallel-size", "2", "--sequence-parallel")


def test_cp_composes_with_tp_pp_zero3_and_interleaving():
    _check(4, [
        ("gpt2", (), _cp(4, "p2p", "--zero-stage", "1")),
        ("bloom", (), _cp(4, "a2a")),
        ("llama", (), _cp(2, "all_gather", *TP2_SP)),
        ("gpt2", (), _cp(2, "a2a", *TP2_SP)),  # learned positions of the TP part of a shard
        ("bloom", (), _cp(2, "p2p", "--pipeline-model-parallel-size", "2", *UNIFORM)),
        ("llama", (), _cp(2, "a2a", "--zero-stage", "3")),
        ("gpt2", LAYERS4, _cp(2, "p2p", "--pipeline-model-parallel-size", "2",
                              "--virtual-pipeline-model-parallel-size", "2", *UNIFORM)),
    ])
