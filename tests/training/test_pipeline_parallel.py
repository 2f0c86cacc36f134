"""PP (and PP x TP) trains the same model as one process: per-step losses, grad norms and
final parameters; tied embedding copies stay bitwise identical."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from megatron3d.model.transformer import TransformerLayer
from tests.helpers.dist import run_distributed
from tests.helpers.nccl_like import coalescing_batches
from tests.helpers.runs import assert_same_run, build, merge_ranks, reference_run, train
from tests.helpers.tiny import train_argv
from tests.helpers.tolerances import EQUIVALENCE_FLAGS, FP32

STEPS = 6
COMMON = ("--clip-grad", "0.5", *EQUIVALENCE_FLAGS)


def _argv(flavour: str, layers: int, *extra: str, steps: int = STEPS) -> list[str]:
    return train_argv(flavour, steps, *COMMON, "--num-layers", str(layers), *extra)


def _reference(flavour: str, layers: int, extra: tuple[str, ...] = ()):
    return reference_run(tuple(_argv(flavour, layers, *extra)))


def _runs(cases: list[tuple[str, int, tuple[str, ...]]]) -> list:
    """One rank of a parallel run: every case in turn, so one spawn serves them all."""
    return [train(_argv(flavour, layers, *extra)) for flavour, layers, extra in cases]


def _nccl_like_runs(cases: list[tuple[str, int, tuple[str, ...]]]) -> list:
    """``_runs`` with gloo posting transfers as NCCL does (``tests/helpers/nccl_like.py``)."""
    with coalescing_batches():
        return [train(_argv(flavour, layers, *extra), directed_links=True)
                for flavour, layers, extra in cases]


def _check(world: int, cases: list[tuple[str, int, tuple[str, ...]]],
           reference_extra: tuple[str, ...] = (), runs=_runs) -> None:
    per_rank = run_distributed(runs, world, cases)
    for i, (flavour, layers, extra) in enumerate(cases):
        merged = merge_ranks([rank_results[i] for rank_results in per_rank])
        try:
            assert_same_run(merged, _reference(flavour, layers, reference_extra), FP32)
        except AssertionError as err:
            raise AssertionError(f"{flavour}, {layers} layers, {extra}: {err}") from err


def test_pp2_uniform_tied_and_untied_with_and_without_recompute():
    pp2 = ("--pipeline-model-parallel-size", "2", "--pp-partition-method", "uniform")
    _check(2, [("gpt2", 2, pp2), ("llama", 2, pp2), ("bloom", 2, pp2)])
    rc = ("--checkpoint-activations",)
    _check(2, [("gpt2", 2, (*pp2, *rc))], reference_extra=rc)


def test_pp2_and_pp3_posting_transfers_as_on_nccl():
    """NCCL's path (each transfer alone, each direction on its own group) trains the same
    model, also where a batch would give one work for all its transfers."""
    _check(2, [("gpt2", 2, ("--pipeline-model-parallel-size", "2"))], runs=_nccl_like_runs)
    _check(3, [("llama", 3, ("--pipeline-model-parallel-size", "3", "--pp-partition-method",
                             "uniform"))], runs=_nccl_like_runs)


def test_pp4_uniform_and_pp4_embeddings_alone():
    """PP=4 uniform over 4 blocks; PP=4 with 2 blocks and type:transformer|embedding puts the
    embedding alone on the first stage and the head alone on the last."""
    _check(4, [
        ("gpt2", 4, ("--pipeline-model-parallel-size", "4", "--pp-partition-method", "uniform")),
        ("bloom", 2, ("--pipeline-model-parallel-size", "4", "--pp-partition-method",
                      "type:transformer|embedding")),
    ])


def test_pp3_transformer_embedding_partition():
    _check(3, [("gpt2", 4, ("--pipeline-model-parallel-size", "3", "--pp-partition-method",
                            "type:transformer|embedding"))])


def test_pp2_tp2():
    _check(4, [("gpt2", 2, ("--pipeline-model-parallel-size", "2",
                            "--tensor-model-parallel-size", "2", "--pp-partition-method",
                            "uniform")),
               ("llama", 2, ("--pipeline-model-parallel-size", "2",
                             "--tensor-model-parallel-size", "2", "--sequence-parallel"))])


def _tied_copies(steps: int):
    result = train(_argv("bloom", 2, "--pipeline-model-parallel-size", "2",
                         "--hidden-dropout", "0.1", steps=steps))
    return result.params.get("embedding.word_embeddings.weight")


def test_tied_embedding_copies_stay_bitwise_identical():
    first, last = run_distributed(_tied_copies, 2, 20)
    assert first is not None and last is not None
    assert torch.equal(first, last)
    assert not torch.equal(first, _reference("bloom", 2).params[
        "embedding.word_embeddings.weight"])  # it trained (20 steps with dropout)


@pytest.mark.parametrize("schedule", ["gpipe"])
def test_gpipe_schedule(schedule):
    _check(2, [("gpt2", 2, ("--pipeline-model-parallel-size", "2", "--pipeline-schedule",
                            schedule, "--global-batch-size", "8"))])


def _dropout_masks() -> tuple[torch.Tensor, torch.Tensor]:
    """This stage's next dropout mask on the default stream and on the TP stream, as the
    trainer's build leaves them."""
    trainer, _ = build(_argv("gpt2", 2, "--pipeline-model-parallel-size", "2",
                             "--pp-partition-method", "uniform", "--hidden-dropout", "0.1"))
    rng = next(m.rng for m in trainer.model.engine.stage.modules()
               if isinstance(m, TransformerLayer))
    ones = torch.ones(256)
    with rng.fork():
        tp_stream = F.dropout(ones, 0.5)
    return F.dropout(ones, 0.5), tp_stream


def test_pipeline_stages_draw_their_own_dropout_masks():
    """Seeds are offset per stage (as in Megatron): with one seed, every stage would drop the
    same positions in the same order."""
    (default0, tp0), (default1, tp1) = run_distributed(_dropout_masks, 2)
    assert not torch.equal(default0, default1)
    assert not torch.equal(tp0, tp1)
