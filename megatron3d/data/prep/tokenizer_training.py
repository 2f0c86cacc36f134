"""Train a SentencePiece model on JSONL or plain text, with settings that suit code and prose.

SentencePiece trains on "sentences" and, by default, normalises whitespace and cannot produce
a newline. Here text keeps its exact spelling: identity normalisation, no whitespace
squeezing, newline and tab as dedicated symbols, byte fallback for unseen characters, so
``detokenize(tokenize(text)) == text`` for any text. Documents are fed as line-aligned pieces
of at most ``piece_chars`` characters, in input order, up to ``max_pieces`` pieces: training is
deterministic for the same input.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Sequence

from megatron3d.errors import DataError

_PIECE_CHARS = 2000


def read_texts(paths: Sequence[str], json_keys: Sequence[str] = ("text",),
               input_format: str = "auto") -> Iterator[str]:
    """Texts from JSONL (values of ``json_keys``) or plain text files (each file one text).

    ``input_format`` "auto" takes ``.jsonl``/``.json`` files as JSONL, everything else as text.
    A missing input is refused here, before training starts; a bad line when it is read.
    """
    for path in paths:
        if not os.path.isfile(path):
            raise DataError(f"{path}: input file not found; pass existing files as --input")
    return _texts(paths, json_keys, input_format)


def _texts(paths: Sequence[str], json_keys: Sequence[str], input_format: str) -> Iterator[str]:
    for path in paths:
        jsonl = input_format == "jsonl" or (
            input_format == "auto" and path.endswith((".jsonl", ".json")))
        try:
            if jsonl:
                yield from _jsonl_texts(path, json_keys)
            else:
                with open(path, encoding="utf-8", errors="replace") as f:
                    yield f.read()
        except OSError as exc:
            raise DataError(f"{path}: cannot read it ({exc.strerror}); pass readable files "
                            "as --input") from None


def _jsonl_texts(path: str, json_keys: Sequence[str]) -> Iterator[str]:
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as exc:  # invalid JSON, or bytes that are not UTF-8
                raise DataError(f"{path}:{number}: invalid JSON ({exc}); fix the line or "
                                "pass --input-format text") from None
            for key in json_keys:
                if not isinstance(record, dict) or not isinstance(record.get(key), str):
                    raise DataError(f"{path}:{number}: no string value for key {key!r}; "
                                    "pass the right --json-keys (each line must be a JSON "
                                    "object)")
                yield record[key]


def pieces(texts: Iterable[str], piece_chars: int = _PIECE_CHARS) -> Iterator[str]:
    """Cut texts into line-aligned pieces of at most ``piece_chars`` (a longer line is split)."""
    for text in texts:
        buf = ""
        for line in text.splitlines(keepends=True):
            while len(line) > piece_chars:
                if buf:
                    yield buf
                    buf = ""
                yield line[:piece_chars]
                line = line[piece_chars:]
            if len(buf) + len(line) > piece_chars and buf:
                yield buf
                buf = ""
            buf += line
        if buf:
            yield buf


def train_sentencepiece(texts: Iterable[str], model_prefix: str, vocab_size: int,
                        model_type: str = "bpe", max_pieces: int = 2_000_000,
                        character_coverage: float = 0.9995) -> str:
    """Train and write ``{model_prefix}.model`` and ``.vocab``; return the model path.

    Special ids: unk 0, bos 1, eos 2 (the eod of ``SentencePieceTokenizer``), no pad.
    """
    import itertools

    import sentencepiece

    os.makedirs(os.path.dirname(os.path.abspath(model_prefix)), exist_ok=True)
    feed = itertools.islice(pieces(texts), max_pieces)
    first = next(feed, None)
    if first is None:  # SentencePiece's own message for this is an internal check
        raise DataError(f"{model_prefix}: the input holds no text to train on; pass --input "
                        "files with text (and the right --json-keys)")
    feed = itertools.chain([first], feed)
    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=feed, model_prefix=model_prefix, vocab_size=vocab_size,
            model_type=model_type, character_coverage=character_coverage,
            normalization_rule_name="identity", remove_extra_whitespaces=False,
            user_defined_symbols=["\n", "\t"], allow_whitespace_only_pieces=True,
            split_digits=True, byte_fallback=True, max_sentence_length=4 * _PIECE_CHARS,
            unk_id=0, bos_id=1, eos_id=2, pad_id=-1, input_sentence_size=0,
            shuffle_input_sentence=False, num_threads=os.cpu_count() or 1, minloglevel=2)
    except RuntimeError as exc:
        raise DataError(f"{model_prefix}: SentencePiece training failed ({exc}); change "
                        "--vocab-size as the message says (lower it for little text)") from None
    return model_prefix + ".model"
