"""``--load`` of a checkpoint builds the model without drawing initial weights (the checkpoint
fills them) and still resumes bitwise; ``--load`` of a directory holding no checkpoint
initialises from the seed as a run without it does."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.helpers.runs import merge_ranks, train, train_single
from tests.helpers.tiny import train_argv

TP2 = ("--tensor-model-parallel-size", "2")
LAYOUTS = {  # gpt2: a TP-replicated position table, tied embeddings (across stages at PP=2)
    "tp2-pp2-zero1-fp32": (*TP2, "--pipeline-model-parallel-size", "2", "--zero-stage", "1",
                           "--pp-partition-method", "uniform"),
    "tp2-dp2-zero0-bf16": (*TP2, "--zero-stage", "0", "--bf16"),
    "tp2-dp2-zero3-bf16": (*TP2, "--zero-stage", "3", "--bf16"),
}


@contextlib.contextmanager
def _no_draws() -> Iterator[None]:
    """Every initial weight is drawn with ``Tensor.normal_``: make drawing one an error."""
    normal = torch.Tensor.normal_

    def refuse(*args, **kwargs) -> None:
        raise AssertionError("drew initial weights although a checkpoint fills them")

    torch.Tensor.normal_ = refuse
    try:
        yield
    finally:
        torch.Tensor.normal_ = normal


def _argv(*extra: str) -> list[str]:
    return train_argv("gpt2", 6, *extra)


def _resume_without_drawing(directory: str, layout: tuple[str, ...]) -> dict:
    """6 steps straight; 3 steps then save; a fresh trainer loads (drawing nothing) to 6."""
    continuous = train(_argv(*layout))
    stopped = train(_argv(*layout, "--save", directory, "--exit-interval", "3"))
    with _no_draws():
        resumed = train(_argv(*layout, "--load", directory))
    return {"continuous": continuous, "stopped": stopped, "resumed": resumed}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_load_draws_nothing_and_resumes_bitwise(tmp_path, layout):
    per_rank = run_distributed(_resume_without_drawing, 4, str(tmp_path / "ckpt"),
                               LAYOUTS[layout], timeout_s=300)
    runs = {k: merge_ranks([r[k] for r in per_rank]) for k in per_rank[0]}
    assert len(runs["resumed"].losses) == 3
    assert runs["stopped"].losses == runs["continuous"].losses[:3]
    assert runs["resumed"].losses == runs["continuous"].losses[3:]  # bitwise
    assert runs["resumed"].grad_norms == runs["continuous"].grad_norms[3:]
    for name, value in runs["continuous"].params.items():
        assert torch.equal(runs["resumed"].params[name], value), name


def test_load_of_a_directory_without_checkpoint_initialises_from_the_seed(tmp_path):
    empty = tmp_path / "no_checkpoint_yet"
    empty.mkdir()
    fresh = train_single(train_argv("gpt2", 3))
    loaded = train_single(train_argv("gpt2", 3, "--load", str(empty)))
    assert loaded.losses == fresh.losses
    for name, value in fresh.params.items():
        assert torch.equal(loaded.params[name], value), name
