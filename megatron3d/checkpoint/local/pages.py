"""A local copy's files written over pages the store already holds, and mapped in one go.

A save every step writes as many bytes as it frees. On tmpfs (and in any page cache) a fresh
file costs a page allocation and zeroing per 4 KiB written, and removing the oldest copy as
much again to free them: more CPU than the copy itself, on cores that training uses. So a
save rewrites the files of the copy it replaces (``store.reuse``) in place, and the copy
received from the peer lands straight in its file's pages through a shared mapping.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux: the pages mapped at once, not faulted


def overwrite(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """``write(f)`` into ``path`` from its start, over the pages the file already has, then
    cut to what was written (created if missing)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    with os.fdopen(fd, "r+b") as f:
        write(f)
        f.truncate()


def mapped(path: Path, size: int | None = None) -> memoryview:
    """``path``'s bytes as a writable view of the file itself (a shared mapping, every page
    mapped at once). With ``size``: the file is first made that long, created if missing,
    and its pages reserved, so that a write through the view cannot fault on a full store
    (``OSError`` here instead)."""
    fd = os.open(path, os.O_RDWR | (os.O_CREAT if size is not None else 0), 0o644)
    try:
        if size is not None:
            os.ftruncate(fd, size)
            if size and hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, size)
        length = os.fstat(fd).st_size
        if not length:
            return memoryview(bytearray())
        return memoryview(mmap.mmap(fd, length, flags=mmap.MAP_SHARED | _POPULATE))
    finally:
        os.close(fd)
