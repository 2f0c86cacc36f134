"""The tokenizer interface and the file checks every tokenizer shares (kept apart from the
factory in ``tokenizer.py``, which imports each concrete tokenizer)."""

from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod
from collections.abc import Sequence

from megatron3d.errors import ConfigError


class Tokenizer(ABC):
    """Text <-> token ids."""

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @property
    @abstractmethod
    def eod(self) -> int: ...

    @abstractmethod
    def tokenize(self, text: str) -> list[int]: ...

    @abstractmethod
    def detokenize(self, ids: Sequence[int]) -> str: ...


def read_json(path: str, what: str) -> dict:
    """A JSON object from a tokenizer file; ConfigError when it is unreadable or not one."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read it as {what} ({first_line(exc)}); give the "
                          "file saved with the tokenizer") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: {what} must hold a JSON object, found a "
                          f"{type(data).__name__}; give the file saved with the tokenizer")
    return data


def first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def require_file(path: str, flag: str) -> None:
    if not os.path.isfile(path):
        raise ConfigError(f"{flag} {path!r}: file not found; give the path of an existing file")
