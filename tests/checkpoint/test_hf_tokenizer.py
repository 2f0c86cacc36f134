"""The export copies the run's tokenizer where transformers' AutoTokenizer reads it, and
transformers then tokenizes text exactly as megatron3d did in training."""

from __future__ import annotations

import pytest

from megatron3d.config import DataConfig, ModelConfig, TrainConfig, TrainingConfig
from megatron3d.convert.hf.to_hf import export_tokenizer
from megatron3d.convert.standalone import tokenizer_spec
from megatron3d.data.tokenizer import build_tokenizer
from tests.data.test_tokenizer import TEXTS, tiny_gpt2_files

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")


def _config(**data: str) -> TrainConfig:
    model = ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=1, seq_length=16)
    return TrainConfig(model=model, training=TrainingConfig(), data=DataConfig(**data))


def _gpt2(tmp_path) -> TrainConfig:
    tiny_gpt2_files(tmp_path)
    return _config(tokenizer_type="GPT2BPETokenizer", vocab_file=str(tmp_path / "vocab.json"),
                   merge_file=str(tmp_path / "merges.txt"))


def _hf(tmp_path) -> TrainConfig:
    vocab, merges = tiny_gpt2_files(tmp_path)
    hf = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, merges))
    hf.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = tokenizers.decoders.ByteLevel()
    (tmp_path / "hf").mkdir()
    hf.save(str(tmp_path / "hf" / "tokenizer.json"))
    return _config(tokenizer_type="PretrainedFromHF",
                   tokenizer_name_or_path=str(tmp_path / "hf"))


@pytest.mark.parametrize("make", [_gpt2, _hf], ids=["GPT2BPETokenizer", "PretrainedFromHF"])
def test_transformers_tokenizes_as_training_did(tmp_path, make):
    cfg = make(tmp_path)
    out = tmp_path / "export"
    out.mkdir()
    assert export_tokenizer(cfg, out).startswith("copied ")
    ours = build_tokenizer(tokenizer_spec(cfg))
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    for text in TEXTS:
        assert theirs.encode(text, add_special_tokens=False) == ours.tokenize(text), text


def test_what_cannot_be_exported_is_said(tmp_path):
    out = tmp_path / "export"
    out.mkdir()
    assert export_tokenizer(_config(), out).startswith("not exported (none: mock data)")
    gone = _config(tokenizer_type="GPT2BPETokenizer", vocab_file="nowhere/vocab.json",
                   merge_file="nowhere/merges.txt")
    assert "nowhere/vocab.json is not here" in export_tokenizer(gone, out)
    assert list(out.iterdir()) == []
