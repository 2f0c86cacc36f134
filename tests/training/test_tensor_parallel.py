"""TP=k trains the same model as TP=1: per-step losses, grad norms and final parameters."""

from __future__ import annotations

from unittest import mock

import pytest

from megatron3d.model import grouped_attention
from megatron3d.model.grouped_attention import Path
from tests.helpers.dist import run_distributed
from tests.helpers.runs import assert_same_run, reference_run, train, train_single
from tests.helpers.tiny import train_argv
from tests.helpers.tolerances import EQUIVALENCE_FLAGS, FP32

FLAVOURS = ("gpt2", "bloom", "llama")
STEPS = 6
# heads 4 and ffn 128 divide by TP 4; vocab 203 pads differently per TP (masked either way).
EXTRA = ("--clip-grad", "0.5", *EQUIVALENCE_FLAGS)


def _argv(flavour: str, tp: int, *extra: str) -> list[str]:
    return train_argv(flavour, STEPS, *EXTRA, "--tensor-model-parallel-size", str(tp), *extra)


def _all_flavours(tp: int, extra: tuple[str, ...]) -> dict:
    """One rank of a TP run: train every flavour in turn (one spawn for all of them)."""
    return {f: train(_argv(f, tp, *extra)) for f in FLAVOURS}


def _reference(flavour: str, extra: tuple[str, ...] = ()):
    return reference_run(tuple(_argv(flavour, 1, *extra)))


# One case per code path: TP2 the plain one (all-reduces; vocabulary padded for 2), TP4 with
# sequence parallelism the other (all-gathers and reduce-scatters; the 4-way splits of heads,
# FFN and sequence; vocabulary padded for 4). TP4 alone and TP2 with SP ran the same code.
@pytest.mark.parametrize(("tp", "extra"), [(2, ()), (4, ("--sequence-parallel",))],
                         ids=["tp2", "tp4-sp"])
def test_tp_matches_single_process(tp, extra):
    results = run_distributed(_all_flavours, tp, tp, extra)
    for flavour in FLAVOURS:
        reference = _reference(flavour)
        for rank, per_flavour in enumerate(results):
            try:
                assert_same_run(per_flavour[flavour], reference, FP32)
            except AssertionError as err:
                raise AssertionError(f"{flavour}, TP={tp} {extra}, rank {rank}: {err}") from err


@pytest.mark.parametrize("sp", [(), ("--sequence-parallel",)], ids=["tp2", "tp2-sp"])
def test_tp_with_dropout_has_the_same_loss_statistics(sp):
    """Attention dropout (and, under SP, all dropout) differs per TP rank by design; the loss
    curve must not."""
    extra = ("--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--lr", "1e-2")
    tp2, tp2_rank1 = run_distributed(_dropout_run, 2, (*extra, *sp))
    reference = train_single(train_argv("gpt2", 30, *extra))
    no_dropout = train_single(train_argv("gpt2", 30, "--lr", "1e-2"))
    # Replicated activations (and so the loss) agree bitwise across TP ranks: hidden dropout
    # draws from the stream shared by the TP group.
    assert tp2.losses == tp2_rank1.losses
    assert tp2.losses[1] != no_dropout.losses[1]  # dropout is really on
    assert reference.losses[1] != no_dropout.losses[1]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    assert abs(mean(tp2.losses[-10:]) - mean(reference.losses[-10:])) < 0.1
    assert tp2.losses[0] == pytest.approx(reference.losses[0], abs=0.05)
    assert mean(tp2.losses[-10:]) < mean(tp2.losses[:10]) - 0.2


def _dropout_run(extra: tuple[str, ...]):
    return train(train_argv("gpt2", 30, *extra, "--tensor-model-parallel-size", "2"))


def _tp3() -> object:
    return train(_argv("gpt2", 3, *TP3_SHAPE))


# Heads, hidden and ffn divisible by 3; the vocabulary (203) pads to 208 at TP=1 but 216 at
# TP=3 (a multiple of 8 x 3): the padding differs, the model must not.
TP3_SHAPE = ("--hidden-size", "48", "--num-attention-heads", "3", "--ffn-hidden-size", "96")


def test_tp3_with_a_vocabulary_that_pads_differently():
    results = run_distributed(_tp3, 3)
    reference = train_single(_argv("gpt2", 1, *TP3_SHAPE))
    for result in results:
        assert_same_run(result, reference, FP32)


def _gqa(groups: int) -> tuple[str, ...]:
    return ("--group-query-attention", "--num-query-groups", str(groups))




def _folded_runs(tp: int) -> dict:
    """Every grouped attention folded, as where SDPA has no grouped kernel (on the CPU: with
    attention dropout, which would make TP and one process draw different masks)."""
    with mock.patch.object(grouped_attention, "grouped_path", lambda *args: Path.FOLD):
        return {f: train(_argv(f, tp, *_gqa(2))) for f in ("llama", "bloom")}


def test_folded_grouped_query_attention_under_tp_matches_single_process():
    """Llama (RoPE) and BLOOM (ALiBi, each rank's bias folded) with 4 heads in 2 groups,
    their query heads folded into rows at TP=2, train the one-process model (which runs the
    grouped flash kernel)."""
    results = run_distributed(_folded_runs, 2, 2)
    for flavour in ("llama", "bloom"):
        reference = _reference(flavour, _gqa(2))
        for rank, per_flavour in enumerate(results):
            try:
                assert_same_run(per_flavour[flavour], reference, FP32)
            except AssertionError as err:
                raise AssertionError(f"{flavour}, rank {rank}: {err}") from err


# Qwen2's bias on the QKV projection alone, split over TP ranks like the weight's grouped
# rows, with Llama 3's RoPE frequency scaling (at head dim 8: 3 of 4 frequencies changed).
QWEN2_LLAMA3 = ("--add-qkv-bias", "--use-rope-scaling",
                "--rope-scaling-original-max-position-embeddings", "64")
GQA_CASES = {"2 groups": _gqa(2), "4 groups": _gqa(4),
             "2 groups, qkv bias, rope scaling": (*_gqa(2), *QWEN2_LLAMA3)}


def _gqa_runs(tp: int) -> dict:
    return {name: train(_argv("llama", tp, *extra)) for name, extra in GQA_CASES.items()}


def test_grouped_query_attention_under_tp_matches_single_process():
    """Llama with 4 query heads in 2 or 4 key/value groups: TP=2 keeps whole groups per rank.
    (One group cannot be split over 2 ranks: validation refuses it.) With a QKV bias (Qwen2)
    and RoPE scaling (Llama 3.x) too."""
    results = run_distributed(_gqa_runs, 2, 2)
    for name, extra in GQA_CASES.items():
        reference = _reference("llama", extra)
        assert ("layers.0.attention.qkv.bias" in reference.params) == ("--add-qkv-bias" in extra)
        for rank, per_case in enumerate(results):
            try:
                assert_same_run(per_case[name], reference, FP32)
            except AssertionError as err:
                raise AssertionError(f"{name}, rank {rank}: {err}") from err
