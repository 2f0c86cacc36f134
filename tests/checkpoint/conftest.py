"""Checkpoints trained once per test session and shared by the tests that only read them
(export, generation, the offline tools): each (2, 2, 2) spawn costs seconds on 2 cores."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers.dist import run_distributed
from tests.helpers.runs import train
from tests.helpers.tiny import train_argv

LAYOUT_222 = ("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
              "--zero-stage", "1", "--pp-partition-method", "uniform")
# With the default std (0.02) the logits of a tiny model 3 steps into training are nearly
# flat (|logit| < 1) and greedy generation repeats one token: comparing such generations
# with transformers' shows little. Weights drawn with std 1 give logits of ~20 that vary
# with the context. A model flag: every run that loads these checkpoints passes it too.
INIT = ("--init-method-std", "1.0")
_GQA = ("--num-attention-heads", "8", "--group-query-attention", "--num-query-groups", "2")
FLAVOURS = {"gpt2": (), "bloom": (), "llama": _GQA,
            # Llama 3.x: RoPE scaling, strong at head dim 4 over an original context of 16
            "llama3": (*_GQA, "--use-rope-scaling", "--rope-scaling-factor", "4",
                       "--rope-scaling-original-max-position-embeddings", "16"),
            "qwen2": (*_GQA, "--add-qkv-bias")}  # Qwen2: a bias on q, k and v only
# The model flags each of FLAVOURS starts from (``tiny.train_argv``'s flavours).
BASE_FLAVOUR = {"llama3": "llama", "qwen2": "llama"}
# How every checkpoint tool ends its final line (``streaming.peak_text``).
PEAK_LINE = re.compile(r"; peak memory \d+(\.\d+)? (B|KiB|MiB|GiB) above the start \(.*"
                       r"\d+(\.\d+)? (B|KiB|MiB|GiB)")


def _train_all(root: str) -> None:
    for flavour, extra in FLAVOURS.items():
        train(train_argv(BASE_FLAVOUR.get(flavour, flavour), 3, *LAYOUT_222, *INIT, *extra,
                         "--save", f"{root}/{flavour}"))


@pytest.fixture(scope="session")
def trained_222(tmp_path_factory) -> Path:
    """``ROOT/{gpt2,bloom,llama,llama3,qwen2}``: 3 steps at (TP, PP, DP) = (2, 2, 2), ZeRO-1,
    weights drawn with std ``INIT``, saved at the end (the Llama family with 8 query heads
    in 2 key/value groups). Read them, never write."""
    root = tmp_path_factory.mktemp("trained_222")
    run_distributed(_train_all, 8, str(root), timeout_s=300)
    return root
