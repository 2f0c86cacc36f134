"""Separate datasets per split (Megatron-LM's --train-data-path, --valid-data-path,
--test-data-path): training reads only the train set, validation only the valid set; a padded
vocabulary of exactly --pad-vocab-size-to rows that cannot hold the tokenizer's stops at start."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import pretrain_gpt
from megatron3d import device as devices
from megatron3d.data.prep.indexed_builder import IndexedDatasetBuilder
from tests.helpers.runs import build

VOCAB = 100  # the null tokenizer's ids; its eod is 100


def _make(prefix: str, low: int, documents: int = 60) -> None:
    """Documents of ids in [low, low + 10), then eod: each split's ids are its own."""
    rng = np.random.default_rng(low)
    with IndexedDatasetBuilder(prefix, np.uint16) as builder:
        for _ in range(documents):
            length = int(rng.integers(8, 40))
            builder.add_document(list(low + rng.integers(0, 10, length)) + [VOCAB])
        builder.finalize()


def _argv(tmp_path, *data: str) -> list[str]:
    return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--train-iters", "3", "--lr", "3e-3", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--log-interval", "1", "--eval-interval", "3",
            "--eval-iters", "1", "--tokenizer-type", "NullTokenizer", "--vocab-size",
            str(VOCAB), "--data-cache-path", str(tmp_path / "cache"), *data]


@pytest.fixture
def splits(tmp_path) -> dict[str, str]:
    prefixes = {}
    for name, low in (("train", 0), ("valid", 40), ("test", 70)):
        prefixes[name] = str(tmp_path / f"{name}_text_document")
        _make(prefixes[name], low)
    return prefixes


def _ids(batches) -> set[int]:
    return {int(t) for b in batches for t in b.tokens.flatten()} - {VOCAB}


def test_validation_reads_the_valid_set_and_training_the_train_set(tmp_path, splits):
    argv = _argv(tmp_path, "--train-data-path", splits["train"], "--valid-data-path",
                 splits["valid"], "--test-data-path", splits["test"])
    devices.init_process_group(devices.LaunchEnv(0, 1, 0, launched=False))
    try:
        trainer, _ = build(argv)
        trainer.run()
        assert _ids(trainer.data.train(0, 4)) <= set(range(0, 10))
        assert _ids(trainer.data.valid(0)) <= set(range(40, 50))
        assert _ids(trainer.data.test(0)) <= set(range(70, 80))
    finally:
        torch.distributed.destroy_process_group()


def test_a_split_without_its_data_path_is_refused_at_start(tmp_path, splits, capsys):
    argv = _argv(tmp_path, "--valid-data-path", splits["valid"], "--data-path", splits["train"])
    assert pretrain_gpt.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert "--valid-data-path needs --train-data-path" in err


def test_pad_vocab_size_below_the_tokenizer_stops_at_start(tmp_path, splits, capsys):
    argv = _argv(tmp_path, "--data-path", splits["train"], "--pad-vocab-size-to", "100")
    assert pretrain_gpt.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert "--pad-vocab-size-to 100 is below the vocabulary of 101 tokens" in err
    assert not (tmp_path / "cache").exists()  # before any index is built
