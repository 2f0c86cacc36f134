"""Selective recompute trains the same model as no recompute: per-step losses, grad norms and
final parameters equal the single-process run without recompute, in one process and at
TP=2 with sequence parallelism."""

from __future__ import annotations

from tests.helpers.dist import run_distributed
from tests.helpers.runs import assert_same_run, reference_run, train, train_single
from tests.helpers.tiny import train_argv
from tests.helpers.tolerances import EQUIVALENCE_FLAGS, FP32

FLAVOURS = ("gpt2", "bloom", "llama")
STEPS = 6
EXTRA = ("--clip-grad", "0.5", *EQUIVALENCE_FLAGS)
SELECTIVE = ("--recompute-granularity", "selective")


def _argv(flavour: str, *extra: str) -> list[str]:
    return train_argv(flavour, STEPS, *EXTRA, *extra)


def _tp2_sp_selective() -> dict:
    return {f: train(_argv(f, "--tensor-model-parallel-size", "2", "--sequence-parallel",
                           *SELECTIVE)) for f in FLAVOURS}


def test_selective_recompute_matches_the_run_without_recompute():
    for flavour in FLAVOURS:
        assert_same_run(train_single(_argv(flavour, *SELECTIVE)),
                        reference_run(tuple(_argv(flavour))), FP32)


def test_selective_recompute_at_tp2_with_sp_matches_the_single_process_run():
    for rank, per_flavour in enumerate(run_distributed(_tp2_sp_selective, 2, timeout_s=300)):
        for flavour in FLAVOURS:
            try:
                assert_same_run(per_flavour[flavour], reference_run(tuple(_argv(flavour))),
                                FP32)
            except AssertionError as err:
                raise AssertionError(f"{flavour}, rank {rank}: {err}") from err
