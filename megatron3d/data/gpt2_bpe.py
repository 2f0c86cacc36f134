"""GPT-2's byte-level BPE from a local ``vocab.json`` and ``merges.txt``, with no dependency.

Text is cut into words by GPT-2's pre-tokenisation rule (contractions, letter runs, digit
runs, other-symbol runs, each with at most one leading space; whitespace runs). Each word's
UTF-8 bytes are spelled with one printable character per byte, then adjacent symbols are
merged, lowest merge rank first, until no listed pair remains; the symbols' ids come from
the vocabulary. Every byte has a symbol, so any text encodes and decodes back exactly.

The rule needs Unicode letter and number classes; the standard ``re`` has none, so they are
built once from ``unicodedata`` (categories L* and N*).
"""

from __future__ import annotations

import functools
import re
import sys
import unicodedata
from collections.abc import Sequence

from megatron3d.data.tokenizer_base import Tokenizer, read_json, require_file
from megatron3d.errors import ConfigError

EOD_TOKEN = "<|endoftext|>"
_CACHE_LIMIT = 1 << 16  # words remembered; cleared when full so memory stays bounded


@functools.cache
def byte_symbols() -> tuple[str, ...]:
    """The character that spells each byte: printable Latin-1 bytes as themselves, the
    others (controls, space, NBSP, soft hyphen) as code points 256, 257, ... in byte order."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) \
        | set(range(0xAE, 0xFF + 1))
    symbols, extra = [], 0
    for b in range(256):
        if b in printable:
            symbols.append(chr(b))
        else:
            symbols.append(chr(256 + extra))
            extra += 1
    return tuple(symbols)


def _category_class(prefix: str) -> str:
    """A regex character class body matching every code point whose category starts with
    ``prefix`` ("L" letters, "N" numbers), as ranges."""
    ranges, start, prev = [], None, None
    for cp in range(sys.maxunicode + 1):
        if unicodedata.category(chr(cp)).startswith(prefix):
            if start is None:
                start = cp
            prev = cp
        elif start is not None:
            ranges.append((start, prev))
            start = None
    if start is not None:
        ranges.append((start, prev))
    return "".join(re.escape(chr(a)) if a == b else f"{re.escape(chr(a))}-{re.escape(chr(b))}"
                   for a, b in ranges)


@functools.cache
def word_pattern() -> re.Pattern:
    """GPT-2's pre-tokenisation rule."""
    letters, numbers = _category_class("L"), _category_class("N")
    return re.compile(
        r"'s|'t|'re|'ve|'m|'ll|'d"
        rf"| ?[{letters}]+| ?[{numbers}]+| ?[^\s{letters}{numbers}]+"
        r"|\s+(?!\S)|\s+"
    )


class ByteLevelBPE:
    """Encode and decode with a byte-level BPE vocabulary and merge list."""

    def __init__(self, vocab: dict[str, int], merges: Sequence[tuple[str, str]]) -> None:
        self.vocab = vocab
        self.id_to_symbol = {i: s for s, i in vocab.items()}
        self.ranks = {pair: rank for rank, pair in enumerate(merges)}
        self._spell = byte_symbols()
        self._unspell = {s: b for b, s in enumerate(self._spell)}
        self._cache: dict[str, list[int]] = {}

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for word in word_pattern().findall(text):
            cached = self._cache.get(word)
            if cached is None:
                if len(self._cache) >= _CACHE_LIMIT:
                    self._cache.clear()
                cached = self._cache[word] = self._encode_word(word)
            ids.extend(cached)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        spelled = "".join(self.id_to_symbol[int(i)] for i in ids)
        data = bytes(self._unspell[c] for c in spelled)
        return data.decode("utf-8", errors="replace")

    def _encode_word(self, word: str) -> list[int]:
        symbols = [self._spell[b] for b in word.encode("utf-8")]
        while len(symbols) > 1:
            ranked = [(self.ranks.get(pair, -1), i)
                      for i, pair in enumerate(zip(symbols, symbols[1:], strict=False))]
            candidates = [(rank, i) for rank, i in ranked if rank >= 0]
            if not candidates:
                break
            _, i = min(candidates)
            symbols = self._merge(symbols, (symbols[i], symbols[i + 1]))
        try:
            return [self.vocab[s] for s in symbols]
        except KeyError as exc:
            raise ConfigError(f"symbol {exc.args[0]!r} of word {word!r} is not in the "
                              "vocabulary; vocab.json and merges.txt do not belong "
                              "together") from None

    @staticmethod
    def _merge(symbols: list[str], pair: tuple[str, str]) -> list[str]:
        """Merge every non-overlapping occurrence of ``pair``, left to right."""
        merged, i = [], 0
        while i < len(symbols):
            if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == pair:
                merged.append(symbols[i] + symbols[i + 1])
                i += 2
            else:
                merged.append(symbols[i])
                i += 1
        return merged


def read_merges(path: str) -> list[tuple[str, str]]:
    """``merges.txt``: an optional ``#version`` line, then one space-separated pair per line."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read it as a GPT-2 merges.txt ({exc}); give the "
                          "UTF-8 merges file saved with the vocab.json") from None
    merges = []
    for number, line in enumerate(lines, 1):
        if not line or (number == 1 and line.startswith("#version")):
            continue
        parts = line.split(" ")
        if len(parts) != 2:
            raise ConfigError(f"{path}:{number}: expected two symbols separated by one "
                              f"space, got {line!r}; is this a GPT-2 merges.txt?")
        merges.append((parts[0], parts[1]))
    return merges


class GPT2BPETokenizer(Tokenizer):
    """GPT-2's tokenizer (``--vocab-file vocab.json --merge-file merges.txt``)."""

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        require_file(vocab_file, "--vocab-file")
        require_file(merge_file, "--merge-file")
        vocab = read_json(vocab_file, "a GPT-2 vocab.json")
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in vocab.values()):
            raise ConfigError(f"{vocab_file}: every value of a GPT-2 vocab.json must be a "
                              "token id (a whole number); is this a GPT-2 vocab.json?")
        if EOD_TOKEN not in vocab:
            raise ConfigError(f"{vocab_file}: no {EOD_TOKEN} token; is this a GPT-2 vocab.json?")
        self._bpe = ByteLevelBPE(vocab, read_merges(merge_file))

    @property
    def vocab_size(self) -> int:
        return len(self._bpe.vocab)

    @property
    def eod(self) -> int:
        return self._bpe.vocab[EOD_TOKEN]

    def tokenize(self, text: str) -> list[int]:
        return self._bpe.encode(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._bpe.decode(ids)
