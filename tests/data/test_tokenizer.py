"""Tokenizers: one interface; SentencePiece, GPT-2 byte-level BPE, Hugging Face, null."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megatron3d.data.gpt2_bpe import ByteLevelBPE, byte_symbols, word_pattern
from megatron3d.data.prep.tokenizer_training import pieces, read_texts, train_sentencepiece
from megatron3d.data.tokenizer import TokenizerSpec, build_tokenizer
from megatron3d.errors import ConfigError, DataError

WORDS = ["alpha", "beta", "gamma", "delta", "def", "return", "(x)", "==", "42", "über"]
TEXTS = ["Hello world's  123abc  ²x   \n\n  def f():\treturn ÿ€ 😀",
         "the the hello", "  leading and trailing  ", "", "I'm 'll've", "naïve café ½ Ⅻ"]


def synthetic_text(lines: int, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    return "\n".join("    " * int(rng.integers(0, 3)) + " ".join(rng.choice(WORDS, 8))
                     for _ in range(lines))


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    prefix = str(tmp_path_factory.mktemp("sp") / "tok")
    return train_sentencepiece([synthetic_text(2000)], prefix, vocab_size=300)


def test_sentencepiece_round_trips_exactly(sp_model):
    tok = build_tokenizer(TokenizerSpec("SentencePieceTokenizer", tokenizer_model=sp_model))
    assert tok.vocab_size == 300 and tok.eod == 2
    for text in [synthetic_text(3, seed=1), *TEXTS]:
        ids = tok.tokenize(text)
        assert all(0 <= i < 300 for i in ids)
        assert tok.detokenize(ids) == text  # newlines, indentation and unseen chars survive


def test_training_input_reading(tmp_path):
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text('{"text": "a\\nb"}\n\n{"text": "c"}\n')
    assert list(read_texts([str(jsonl)])) == ["a\nb", "c"]
    plain = tmp_path / "c.txt"
    plain.write_text("plain text")
    assert list(read_texts([str(plain)])) == ["plain text"]
    jsonl.write_text('{"body": "x"}\n')
    with pytest.raises(DataError, match=r"c.jsonl:1: no string value for key 'text'"):
        list(read_texts([str(jsonl)]))
    long = "x" * 5 + "\n" + "y" * 12 + "\n"
    assert list(pieces([long], piece_chars=8)) == ["xxxxx\n", "yyyyyyyy", "yyyy\n"]


def test_null_tokenizer():
    tok = build_tokenizer(TokenizerSpec("NullTokenizer", vocab_size=100))
    assert tok.vocab_size == 101 and tok.eod == 100
    assert tok.tokenize("5 7  99") == [5, 7, 99] and tok.detokenize([1, 2]) == "1 2"


def tiny_gpt2_files(tmp_path):
    """A byte-level vocabulary (ids = byte values) plus four merges and the eod token."""
    vocab = {s: b for b, s in enumerate(byte_symbols())}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("l", "l")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n"
                                                                    for a, b in merges))
    return vocab, merges


def test_gpt2_bpe_by_hand(tmp_path):
    vocab, _ = tiny_gpt2_files(tmp_path)
    tok = build_tokenizer(TokenizerSpec("GPT2BPETokenizer", vocab_file=str(tmp_path / "vocab.json"),
                                        merge_file=str(tmp_path / "merges.txt")))
    assert tok.vocab_size == 261 and tok.eod == 260
    # "the" -> t|he; " the" -> Ġthe; " hello" -> Ġ|he|ll|o
    assert tok.tokenize("the the hello") == [116, 257, 258, 32, 257, 259, 111]
    for text in TEXTS:
        assert tok.detokenize(tok.tokenize(text)) == text


def test_byte_symbols_and_pretokenisation():
    symbols = byte_symbols()
    assert len(set(symbols)) == 256 and all(s.isprintable() for s in symbols)
    assert symbols[ord("A")] == "A" and symbols[ord(" ")] == "Ġ" and symbols[ord("\n")] == "Ċ"
    assert word_pattern().findall("I'll  see 42x!!\n\n") == [
        "I", "'ll", " ", " see", " 42", "x", "!!", "\n\n"]


def test_gpt2_bpe_matches_huggingface_tokenizers(tmp_path):
    tokenizers = pytest.importorskip(
        "tokenizers", reason="the 'tokenizers' package is not installed: pip install tokenizers")
    vocab, merges = tiny_gpt2_files(tmp_path)
    ours = ByteLevelBPE(vocab, merges)
    theirs = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, merges))
    theirs.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    for text in TEXTS + [synthetic_text(5)]:
        assert ours.encode(text) == theirs.encode(text).ids, text


def test_huggingface_tokenizer_from_a_local_directory(tmp_path):
    tokenizers = pytest.importorskip(
        "tokenizers", reason="the 'tokenizers' package is not installed: pip install tokenizers")
    vocab, merges = tiny_gpt2_files(tmp_path)
    hf = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, merges))
    hf.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = tokenizers.decoders.ByteLevel()
    (tmp_path / "hf").mkdir()
    hf.save(str(tmp_path / "hf" / "tokenizer.json"))
    (tmp_path / "hf" / "tokenizer_config.json").write_text('{"eos_token": "<|endoftext|>"}')
    tok = build_tokenizer(TokenizerSpec("PretrainedFromHF",
                                        tokenizer_name_or_path=str(tmp_path / "hf")))
    assert tok.vocab_size == 261 and tok.eod == 260
    assert tok.tokenize("the the hello") == [116, 257, 258, 32, 257, 259, 111]
    assert tok.detokenize(tok.tokenize(TEXTS[0])) == TEXTS[0]


def test_huggingface_needs_a_local_tokenizer(tmp_path):
    with pytest.raises(ConfigError, match="no tokenizer.json|needs the 'tokenizers' package"):
        build_tokenizer(TokenizerSpec("PretrainedFromHF", tokenizer_name_or_path="gpt2"))


def test_tokenizer_configuration_errors(tmp_path):
    with pytest.raises(ConfigError, match="needs --tokenizer-model"):
        build_tokenizer(TokenizerSpec("SentencePieceTokenizer"))
    with pytest.raises(ConfigError, match="--tokenizer-model .*missing.model.*not found"):
        build_tokenizer(TokenizerSpec("SentencePieceTokenizer",
                                      tokenizer_model=str(tmp_path / "missing.model")))
    with pytest.raises(ConfigError, match="unknown --tokenizer-type 'Bert'"):
        build_tokenizer(TokenizerSpec("Bert"))
    with pytest.raises(ConfigError, match="needs --merge-file"):
        build_tokenizer(TokenizerSpec("GPT2BPETokenizer", vocab_file="v.json"))
    (tmp_path / "vocab.json").write_text('{"a": 0}')
    (tmp_path / "merges.txt").write_text("")
    with pytest.raises(ConfigError, match="no <\\|endoftext\\|> token"):
        build_tokenizer(TokenizerSpec("GPT2BPETokenizer", vocab_file=str(tmp_path / "vocab.json"),
                                      merge_file=str(tmp_path / "merges.txt")))


def test_unreadable_tokenizer_files_are_one_line_errors(tmp_path):
    """Garbage where a tokenizer file should be: ConfigError naming the file, no traceback."""
    (tmp_path / "bad.model").write_bytes(b"not a model")
    with pytest.raises(ConfigError, match="bad.model' is not a SentencePiece model"):
        build_tokenizer(TokenizerSpec("SentencePieceTokenizer",
                                      tokenizer_model=str(tmp_path / "bad.model")))
    (tmp_path / "merges.txt").write_text("")
    gpt2 = TokenizerSpec("GPT2BPETokenizer", vocab_file=str(tmp_path / "vocab.json"),
                         merge_file=str(tmp_path / "merges.txt"))
    for text, message in [("{oops", "cannot read it as a GPT-2 vocab.json"),
                          ('["<|endoftext|>"]', "must hold a JSON object, found a list"),
                          ('{"<|endoftext|>": "0"}', "every value .* must be a token id")]:
        (tmp_path / "vocab.json").write_text(text)
        with pytest.raises(ConfigError, match=message):
            build_tokenizer(gpt2)
    (tmp_path / "vocab.json").write_text('{"<|endoftext|>": 0}')
    (tmp_path / "merges.txt").write_bytes(b"\xff\xfe a b\n")
    with pytest.raises(ConfigError, match="cannot read it as a GPT-2 merges.txt"):
        build_tokenizer(gpt2)
    pytest.importorskip("tokenizers", reason="the 'tokenizers' package is not installed")
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ConfigError, match="tokenizer.json is not a fast tokenizer file"):
        build_tokenizer(TokenizerSpec("PretrainedFromHF", tokenizer_name_or_path=str(tmp_path)))


def test_null_tokenizer_refuses_what_is_not_an_id():
    tok = build_tokenizer(TokenizerSpec("NullTokenizer", vocab_size=10))
    for text, message in [("1 two", "word 'two' is not a token id"),
                          ("1 -1", r"token id -1 is outside \[0, 10\)"),
                          ("10", r"token id 10 is outside \[0, 10\)")]:  # 10 is eod
        with pytest.raises(DataError, match=message):
            tok.tokenize(text)
    with pytest.raises(ConfigError, match="--vocab-size >= 1, got 0"):
        build_tokenizer(TokenizerSpec("NullTokenizer", vocab_size=0))


def test_flags_a_tokenizer_type_ignores_are_named():
    assert TokenizerSpec("NullTokenizer", vocab_size=5).unused_flags() == []
    assert TokenizerSpec("SentencePieceTokenizer", tokenizer_model="m", vocab_file="v",
                         vocab_size=5).unused_flags() == ["--vocab-file", "--vocab-size"]
