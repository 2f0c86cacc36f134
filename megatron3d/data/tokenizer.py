"""Tokenizers behind one interface, chosen by ``--tokenizer-type`` as Megatron names them.

``vocab_size`` is the logical vocabulary (the model pads it); ``eod`` is the id appended
after each document with ``--append-eod``. Nothing here downloads: every tokenizer loads from
local files, and a missing file is a ``ConfigError`` naming the flag and the path.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Literal

from megatron3d.data.gpt2_bpe import GPT2BPETokenizer
from megatron3d.data.tokenizer_base import Tokenizer, first_line, read_json, require_file
from megatron3d.errors import ConfigError, DataError

TokenizerType = Literal["SentencePieceTokenizer", "PretrainedFromHF", "GPT2BPETokenizer",
                        "NullTokenizer"]
TOKENIZER_TYPES: tuple[str, ...] = ("SentencePieceTokenizer", "PretrainedFromHF",
                                    "GPT2BPETokenizer", "NullTokenizer")


class NullTokenizer(Tokenizer):
    """For tests: the text is whitespace-separated ids below ``vocab_size``; eod is one more.

    As in Megatron, the vocabulary is ``vocab_size + 1`` so eod never collides with data.
    """

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < 1:
            raise ConfigError(f"NullTokenizer needs --vocab-size >= 1, got {vocab_size}")
        self._size = vocab_size

    @property
    def vocab_size(self) -> int:
        return self._size + 1

    @property
    def eod(self) -> int:
        return self._size

    def tokenize(self, text: str) -> list[int]:
        """DataError for a word that is not an id in ``[0, vocab_size)``: it is bad input, and
        a wrapped or negative id must never reach a dataset."""
        ids = []
        for word in text.split():
            try:
                ids.append(int(word))
            except ValueError:
                raise DataError(f"NullTokenizer: word {word[:40]!r} is not a token id; its text "
                                "must be whitespace-separated whole numbers") from None
        bad = [i for i in (min(ids, default=0), max(ids, default=0)) if not 0 <= i < self._size]
        if bad:
            raise DataError(f"NullTokenizer: token id {bad[0]} is outside [0, {self._size}) "
                            f"(--vocab-size {self._size}); fix the id or raise --vocab-size")
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model file; eod is the model's end-of-sentence id."""

    def __init__(self, model_file: str) -> None:
        import sentencepiece

        require_file(model_file, "--tokenizer-model")
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
        except (RuntimeError, OSError) as exc:
            raise ConfigError(f"--tokenizer-model {model_file!r} is not a SentencePiece model "
                              f"({first_line(exc)}); give the .model file "
                              "tools/train_tokenizer.py wrote") from None
        if self._sp.eos_id() < 0:
            raise ConfigError(f"{model_file}: the SentencePiece model has no end-of-sentence "
                              "token; retrain it with eos_id set (tools/train_tokenizer.py does)")

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def eod(self) -> int:
        return self._sp.eos_id()

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text, out_type=int)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])


_EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>")


class HFTokenizer(Tokenizer):
    """A local Hugging Face fast tokenizer (``tokenizer.json``) via the ``tokenizers`` package.

    eod is ``eos_token`` from ``tokenizer_config.json`` when present, else the first of the
    usual end-of-text tokens the vocabulary has.
    """

    def __init__(self, name_or_path: str) -> None:
        try:
            import tokenizers
        except ImportError:
            raise ConfigError("--tokenizer-type PretrainedFromHF needs the 'tokenizers' "
                              "package: pip install tokenizers") from None
        directory = name_or_path if os.path.isdir(name_or_path) else os.path.dirname(name_or_path)
        path = os.path.join(name_or_path, "tokenizer.json") if os.path.isdir(name_or_path) \
            else name_or_path
        if not os.path.isfile(path):
            raise ConfigError(f"--tokenizer-name-or-path {name_or_path!r}: no tokenizer.json "
                              "there; give a local directory or file holding a fast tokenizer "
                              "(models are never downloaded: fetch it first)")
        try:
            self._tok = tokenizers.Tokenizer.from_file(path)
        except Exception as exc:  # the Rust binding raises a bare Exception
            raise ConfigError(f"--tokenizer-name-or-path {name_or_path!r}: {path} is not a "
                              f"fast tokenizer file ({first_line(exc)}); give the "
                              "tokenizer.json saved with the model") from None
        self._eod = self._find_eod(directory, path)

    def _find_eod(self, directory: str, path: str) -> int:
        names = list(_EOS_NAMES)
        config = os.path.join(directory, "tokenizer_config.json")
        if os.path.isfile(config):
            eos = read_json(config, "tokenizer_config.json").get("eos_token")
            if isinstance(eos, dict):
                eos = eos.get("content")
            if eos:
                names.insert(0, eos)
        for name in names:
            token_id = self._tok.token_to_id(name)
            if token_id is not None:
                return token_id
        raise ConfigError(f"{path}: no end-of-text token found (tried {names}); set eos_token "
                          "in tokenizer_config.json beside it")

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eod(self) -> int:
        return self._eod

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


@dataclass(frozen=True)
class TokenizerSpec:
    """Everything that picks and loads a tokenizer: picklable, so workers can rebuild it."""

    tokenizer_type: str
    tokenizer_model: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    tokenizer_name_or_path: str | None = None
    vocab_size: int | None = None  # NullTokenizer only

    def unused_flags(self) -> list[str]:
        """Flags given that this tokenizer type ignores: a caller refuses them rather than
        silently ignoring, e.g., a --vocab-file meant for another tokenizer."""
        used = _USES.get(self.tokenizer_type, ())
        return ["--" + f.name.replace("_", "-") for f in fields(self)
                if f.name not in ("tokenizer_type", *used) and getattr(self, f.name) is not None]


_USES = {"SentencePieceTokenizer": ("tokenizer_model",),
         "PretrainedFromHF": ("tokenizer_name_or_path",),
         "GPT2BPETokenizer": ("vocab_file", "merge_file"), "NullTokenizer": ("vocab_size",)}


def build_tokenizer(spec: TokenizerSpec) -> Tokenizer:
    """The tokenizer ``spec`` names; ``ConfigError`` when a flag it needs is missing."""
    kind = spec.tokenizer_type
    if kind == "SentencePieceTokenizer":
        return SentencePieceTokenizer(_need(spec.tokenizer_model, "--tokenizer-model", kind))
    if kind == "PretrainedFromHF":
        return HFTokenizer(_need(spec.tokenizer_name_or_path, "--tokenizer-name-or-path", kind))
    if kind == "GPT2BPETokenizer":
        return GPT2BPETokenizer(_need(spec.vocab_file, "--vocab-file", kind),
                                _need(spec.merge_file, "--merge-file", kind))
    if kind == "NullTokenizer":
        return NullTokenizer(_need(spec.vocab_size, "--vocab-size", kind))
    raise ConfigError(f"unknown --tokenizer-type {kind!r}; expected one of "
                      f"{', '.join(TOKENIZER_TYPES)}")


def _need(value, flag: str, kind: str):
    if value is None:
        raise ConfigError(f"--tokenizer-type {kind} needs {flag}")
    return value
