"""Crafted or damaged Megatron-Core checkpoints: refused with one line before anything stays on
disk, never imported as garbage (overlapping chunks, non-finite weights) and never a traceback
or a MemoryError (a huge pickle length, a non-ASCII tracker digit, text where a number
belongs, a billion layers)."""

from __future__ import annotations

import argparse
import pickle
import struct

import pytest
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

from tests.checkpoint.test_import_megatron import (
    FUSED_NORMS,
    HIDDEN,
    VOCAB,
    _args,
    _ours,
    _refused,
    _theirs,
    _write,
)

EMBEDDING = "embedding.word_embeddings.weight"


@pytest.fixture
def mcore(tmp_path):
    """A valid stacked-layer checkpoint under ``tmp_path/mcore``; its iteration directory."""
    _write(tmp_path / "mcore", _theirs(_ours(), True, FUSED_NORMS))
    return tmp_path / "mcore" / "iter_0000005"


def _rewrite_metadata(iteration, change) -> None:
    md = pickle.loads((iteration / ".metadata").read_bytes())  # written by this test: trusted
    change(md.state_dict_metadata)
    (iteration / ".metadata").write_bytes(pickle.dumps(md))


def test_overlapping_chunks_whose_sizes_add_up_are_refused(tmp_path, capsys, mcore):
    """Two chunks over the top half of the embedding add up to its size; the bottom half
    would keep uninitialised memory."""
    half = torch.Size([VOCAB // 2, HIDDEN])
    top = ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=half)
    _rewrite_metadata(mcore, lambda md: setattr(md[EMBEDDING], "chunks", [top, top]))
    _refused(tmp_path, capsys, f"the chunks of {EMBEDDING} overlap")


def test_chunks_outside_the_tensor_are_refused(tmp_path, capsys, mcore):
    whole = torch.Size([VOCAB, HIDDEN])
    out = ChunkStorageMetadata(offsets=torch.Size([VOCAB, 0]), sizes=whole)
    _rewrite_metadata(mcore, lambda md: setattr(md[EMBEDDING], "chunks", [out]))
    _refused(tmp_path, capsys, f"a chunk of {EMBEDDING} lies outside its shape")


def test_non_finite_weights_are_refused_and_nothing_stays(tmp_path, capsys):
    state = _theirs(_ours(), True, FUSED_NORMS)
    state["decoder.final_layernorm.weight"][3] = float("nan")
    _write(tmp_path / "mcore", state)
    _refused(tmp_path, capsys, "decoder.final_layernorm.weight holds a non-finite value")


def test_a_huge_pickle_length_in_the_metadata_is_one_line(tmp_path, capsys, mcore):
    for length in (2**63, 2**40):  # OverflowError, MemoryError inside the unpickler
        (mcore / ".metadata").write_bytes(b"\x80\x04\x8e" + struct.pack("<Q", length) + b"x.")
        _refused(tmp_path, capsys, ".metadata cannot be read safely")


@pytest.mark.parametrize("text", ["\u00b2", "\u0665", "1" * 5000])
def test_a_tracker_that_is_not_an_ascii_iteration_is_one_line(tmp_path, capsys, mcore, text):
    (tmp_path / "mcore" / "latest_checkpointed_iteration.txt").write_text(text)
    _refused(tmp_path, capsys, "latest_checkpointed_iteration.txt names")


@pytest.mark.parametrize(("changes", "expected"), [
    ({"norm_epsilon": "abc"}, "norm_epsilon='abc', expected a finite number"),
    ({"rotary_base": float("nan")}, "rotary_base=nan, expected a finite number"),
    ({"init_method_std": [1]}, "init_method_std=[1], expected a finite number"),
    ({"num_layers": 10**9}, "num_layers=1000000000, expected a whole number in [1, 65536]"),
    ({"hidden_size": 2**40}, "hidden_size=1099511627776, expected a whole number in [1, "),
    ({"padded_vocab_size": 2**40}, "padded_vocab_size=1099511627776"),
    ({"ffn_hidden_size": -4}, "ffn_hidden_size=-4, expected a whole number in [1, "),
    ({"num_layers": 60000}, "stores 4 transformer layers but the model has 60000"),
], ids=["text epsilon", "nan", "list", "a billion layers", "huge hidden", "huge vocab",
        "negative ffn", "more layers than stored"])
def test_stored_arguments_out_of_range_are_one_line(tmp_path, capsys, changes, expected):
    _write(tmp_path / "mcore", _theirs(_ours(), True, FUSED_NORMS),
           {"args": argparse.Namespace(**{**vars(_args()), **changes})})
    _refused(tmp_path, capsys, expected)
