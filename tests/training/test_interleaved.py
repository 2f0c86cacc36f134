"""Interleaved 1F1B trains the same model as one process: per-step losses, grad norms and
final parameters, for PP {2, 4} x v {2, 3} (uneven layer counts too), with TP=2, with DP=2
under ZeRO-0, 1 and 3 (resharding or not), tied (GPT-2) and untied (Llama) embeddings;
resume is bitwise."""

from __future__ import annotations

import torch

from tests.helpers.dist import run_distributed
from tests.helpers.nccl_like import coalescing_batches
from tests.helpers.runs import assert_same_run, merge_ranks, reference_run, train
from tests.helpers.tiny import train_argv
from tests.helpers.tolerances import EQUIVALENCE_FLAGS, FP32

STEPS = 6
COMMON = ("--clip-grad", "0.5", *EQUIVALENCE_FLAGS)


def _argv(flavour: str, layers: int, *extra: str) -> list[str]:
    return train_argv(flavour, STEPS, *COMMON, "--num-layers", str(layers), *extra)


def _layout(pp: int, v: int, *extra: str) -> tuple[str, ...]:
    return ("--pipeline-model-parallel-size", str(pp), "--virtual-pipeline-model-parallel-size",
            str(v), *extra)


def _runs(cases: list[tuple[str, int, tuple[str, ...]]]) -> list:
    """One rank of a parallel run: every case in turn, so one spawn serves them all."""
    return [train(_argv(flavour, layers, *extra)) for flavour, layers, extra in cases]


def _nccl_like_runs(cases: list[tuple[str, int, tuple[str, ...]]]) -> list:
    """``_runs`` with gloo posting transfers as NCCL does (``tests/helpers/nccl_like.py``)."""
    with coalescing_batches():
        return [train(_argv(flavour, layers, *extra), directed_links=True)
                for flavour, layers, extra in cases]


def _check(world: int, cases: list[tuple[str, int, tuple[str, ...]]], runs=_runs,
           reference_extra: tuple[str, ...] = ()) -> None:
    per_rank = run_distributed(runs, world, cases, timeout_s=300)
    for i, (flavour, layers, extra) in enumerate(cases):
        merged = merge_ranks([rank_results[i] for rank_results in per_rank])
        reference = reference_run(tuple(_argv(flavour, layers, *reference_extra)))
        try:
            assert_same_run(merged, reference, FP32)
        except AssertionError as err:
            raise AssertionError(f"{flavour}, {layers} layers, {extra}: {err}") from err


def test_pp2_with_two_and_three_chunks():
    """5 blocks over 2 x 2 virtual stages by parameters (uneven), and 6 over 2 x 3."""
    _check(2, [("gpt2", 5, _layout(2, 2)), ("llama", 5, _layout(2, 2)),
               ("gpt2", 6, _layout(2, 3, "--pp-partition-method", "uniform")),
               ("llama", 4, _layout(2, 3, "--pp-partition-method", "uniform"))])


def test_posting_transfers_as_on_nccl():
    """NCCL's path (each transfer alone, each direction on its own group) at PP=2 x v=2,
    where both ranks send to each other in both directions, and at PP=3 x v=2, where the
    last rank feeds the first: the same model, also where a batch would give one work for
    all its transfers."""
    _check(2, [("gpt2", 4, _layout(2, 2))], runs=_nccl_like_runs)
    batch = ("--global-batch-size", "12")  # 6 micro-batches: a multiple of PP = 3
    _check(3, [("llama", 6, _layout(3, 2, "--pp-partition-method", "uniform", *batch))],
           runs=_nccl_like_runs, reference_extra=batch)


def test_pp4_with_two_and_three_chunks():
    """PP=4: 8 blocks in Megatron's spelling, which gives Megatron's layout whatever the
    method (1 block per virtual stage, the embedding with the first, the head with the last),
    and 9 blocks over 4 x 3 virtual stages, uniform (the embeddings count as layers)."""
    per_stage = ("--pipeline-model-parallel-size", "4", "--num-layers-per-virtual-pipeline-stage",
                 "1", "--pp-partition-method", "type:transformer|embedding")
    _check(4, [("gpt2", 8, per_stage), ("llama", 9, _layout(4, 3, "--pp-partition-method",
                                                            "uniform"))])


def test_with_tp2_and_with_dp2_zero0_zero1_and_zero3():
    """Small buckets: each chunk's are reduced from its own last backward (ZeRO-0/1); ZeRO-3
    gathered for the whole step reduces each unit once."""
    small = ("--reduce-bucket-size", "2000")
    _check(4, [
        ("gpt2", 4, _layout(2, 2, "--tensor-model-parallel-size", "2", "--sequence-parallel")),
        ("llama", 4, _layout(2, 2, "--tensor-model-parallel-size", "2")),
        ("llama", 4, _layout(2, 2, *small)),
        ("gpt2", 4, _layout(2, 2, "--zero-stage", "1", *small)),
        ("llama", 5, _layout(2, 2, "--zero-stage", "3")),
        ("gpt2", 4, _layout(2, 2, "--zero-stage", "3", "--zero3-reshard-after-forward", "false")),
    ])


def _continue_after_save(directory: str) -> dict:
    """6 steps straight; 3 steps, save and stop; a fresh trainer loads and runs to 6 (same
    layout, dropout on: bitwise), and the same checkpoint loads into plain 1F1B at PP=2 and
    into PP=1 x DP=2 (dropout off there: fresh dropout streams in another layout)."""
    dropout = ("--hidden-dropout", "0.1", "--attention-dropout", "0.1")
    layout = _layout(2, 2, "--zero-stage", "1")
    continuous = train(_argv("gpt2", 4, *layout, *dropout))
    stopped = train(_argv("gpt2", 4, *layout, *dropout, "--save", directory,
                          "--exit-interval", "3"))
    resumed = train(_argv("gpt2", 4, *layout, *dropout, "--load", directory))
    runs = {"continuous": continuous, "stopped": stopped, "resumed": resumed}
    plain = f"{directory}-plain"
    runs["no_dropout"] = train(_argv("gpt2", 4, *layout))
    train(_argv("gpt2", 4, *layout, "--save", plain, "--exit-interval", "3"))
    runs["pp2"] = train(_argv("gpt2", 4, "--pipeline-model-parallel-size", "2", "--load", plain))
    runs["dp2"] = train(_argv("gpt2", 4, "--load", plain))
    return runs


def test_resume_is_bitwise_exact_and_checkpoints_load_into_other_layouts(tmp_path):
    per_rank = run_distributed(_continue_after_save, 4, str(tmp_path / "ckpt"), timeout_s=300)
    runs = {k: merge_ranks([r[k] for r in per_rank])
            for k in ("continuous", "stopped", "resumed", "no_dropout")}
    assert runs["stopped"].losses == runs["continuous"].losses[:3]
    assert runs["resumed"].losses == runs["continuous"].losses[3:]  # bitwise, dropout on
    assert runs["resumed"].grad_norms == runs["continuous"].grad_norms[3:]
    for name, value in runs["continuous"].params.items():
        assert torch.equal(runs["resumed"].params[name], value), name
    expected = torch.tensor(runs["no_dropout"].losses[3:])
    for name in ("pp2", "dp2"):
        last = next(r[name] for r in reversed(per_rank) if r[name].last_stage)
        torch.testing.assert_close(torch.tensor(last.losses), expected, **FP32)
