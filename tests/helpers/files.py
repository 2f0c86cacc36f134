"""Which checkpoint files a process reads, counted where every rank file is opened."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch


@contextlib.contextmanager
def opened_files() -> Iterator[list[str]]:
    """The names of the files ``torch.load`` opens in this process while inside, in order
    (every rank file is read through it: ``checkpoint/io.read_rank``)."""
    names: list[str] = []
    original = torch.load

    def counting(f, *args, **kwargs):
        if isinstance(f, str | Path):
            names.append(Path(f).name)
        return original(f, *args, **kwargs)

    torch.load = counting
    try:
        yield names
    finally:
        torch.load = original
