"""import_hf records the tokenizer saved beside the model (copied into the checkpoint, so a
moved checkpoint still has it): export_hf writes it next to the exported model, where
transformers reads it and tokenizes as the import's source did; the tools load it."""

from __future__ import annotations

import json
import shutil

import pytest

from megatron3d.convert.standalone import load_model
from megatron3d.data.prep.tokenizer_training import train_sentencepiece
from megatron3d.data.tokenizer import build_tokenizer
from tests.checkpoint.test_hf_continue import _hf_model, _tokenizer
from tests.data.test_tokenizer import TEXTS, synthetic_text
from tests.helpers.tools import load_tool, tool_logging

transformers = pytest.importorskip("transformers")
import_hf, export_hf = load_tool("checkpoint/import_hf.py"), load_tool("checkpoint/export_hf.py")
reshape = load_tool("checkpoint/reshape.py")


def _import_and_move(tmp_path, flavour: str) -> tuple[int, str]:
    """Import ``flavour`` with its tokenizer, then move the checkpoint and delete the
    model directory: only the checkpoint's own copy is left. Its vocabulary and the
    moved checkpoint."""
    vocab, _ = _tokenizer(flavour, tmp_path / "hf")
    _hf_model(flavour, tmp_path / "hf", vocab)
    with tool_logging():
        assert import_hf.main(["--hf", str(tmp_path / "hf"), "--save",
                               str(tmp_path / "ckpt")]) == 0
    shutil.rmtree(tmp_path / "hf")
    (tmp_path / "ckpt").rename(tmp_path / "moved")
    return vocab, str(tmp_path / "moved")


@pytest.mark.parametrize(("flavour", "files"), [
    ("bloom", ["tokenizer.json"]), ("gpt2", ["merges.txt", "vocab.json"])],
    ids=["PretrainedFromHF", "GPT2BPETokenizer"])
def test_an_export_of_an_import_carries_its_tokenizer(tmp_path, flavour, files):
    _, moved = _import_and_move(tmp_path, flavour)
    with tool_logging():
        assert export_hf.main(["--load", moved, "--output", str(tmp_path / "back"),
                               "--no-verify"]) == 0
    assert all((tmp_path / "back" / f).is_file() for f in files)
    ours = build_tokenizer(load_model(moved).tokenizer)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "back")
    for text in TEXTS:
        assert theirs.encode(text, add_special_tokens=False) == ours.tokenize(text), text
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["eos_token_id"] == ours.eod == 260


def test_a_sentencepiece_model_is_recorded_too(tmp_path):
    vocab, moved = _import_and_move(tmp_path, "llama")
    spec = load_model(moved).tokenizer
    assert spec.tokenizer_type == "SentencePieceTokenizer"
    assert build_tokenizer(spec).vocab_size == vocab


def test_a_tokenizer_unlike_the_model_is_a_notice(tmp_path, capsys):
    train_sentencepiece([synthetic_text(400)], str(tmp_path / "hf" / "tokenizer"), 320)
    _hf_model("llama", tmp_path / "hf", 300)
    capsys.readouterr()
    with tool_logging():
        assert import_hf.main(["--hf", str(tmp_path / "hf"), "--save",
                               str(tmp_path / "ckpt")]) == 0
    assert ("notice: the tokenizer beside the model (tokenizer.model) has 320 tokens but "
            "config.json's vocab_size is 300: training needs a tokenizer of 300") \
        in capsys.readouterr().out


def test_a_reshaped_import_keeps_its_tokenizer(tmp_path):
    """reshape.py rewrites the checkpoint: the tokenizer files the import copied into it come
    along, so the source can go and the reshaped one still exports them."""
    _, moved = _import_and_move(tmp_path, "gpt2")
    with tool_logging():
        assert reshape.main(["--load", moved, "--save", str(tmp_path / "tp2"),
                             "--tensor-model-parallel-size", "2",
                             "--pipeline-model-parallel-size", "1"]) == 0
    shutil.rmtree(moved)
    with tool_logging():
        assert export_hf.main(["--load", str(tmp_path / "tp2"), "--output",
                               str(tmp_path / "back"), "--no-verify"]) == 0
    assert (tmp_path / "back" / "vocab.json").is_file()
    assert (tmp_path / "back" / "merges.txt").is_file()
