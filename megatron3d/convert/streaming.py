"""Read a checkpoint's logical tensors one at a time, in memory near the largest tensor.

``CheckpointReader`` memory-maps the rank files. The pages a tensor's chunks were read from
stay mapped, and counted in the process's resident memory, as long as the reader lives, so
streaming a whole model through one reader would end up holding the model's bytes.
``logical_tensors`` gives each tensor's pages back to the kernel once the caller is done
with it: ``madvise(MADV_PAGEOUT)`` (Linux 5.4+) is a hint that never changes data (pages read
again are read from the file), so on another system, or an older kernel, the pages merely
stay mapped (clean and reclaimable). ``PeakMemory`` measures what the tools report, and
``peak_text`` says it the same way in every tool's final line.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import resource
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from megatron3d.checkpoint.chunks import index_chunks
from megatron3d.checkpoint.reader import CheckpointReader

_MADV_PAGEOUT = getattr(mmap, "MADV_PAGEOUT", 21)  # linux/mman.h
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
if _LIBC is not None:
    _LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def logical_tensors(reader: CheckpointReader,
                    wanted: Iterable[tuple[str, str]]) -> Iterator[tuple[str, str, torch.Tensor]]:
    """``(name, kind, tensor)`` for each ``(name, kind)`` in turn; the tensor is the caller's
    copy, and its source pages are paged out when the caller asks for the next one."""
    index = index_chunks(c for f in reader.files for c in f["chunks"])
    for name, kind in wanted:
        yield name, kind, reader.tensor(name, kind)
        for chunk in index[(name, kind)]:
            _page_out(chunk["data"])


def _page_out(tensor: torch.Tensor) -> None:
    """Advise the kernel to reclaim the whole pages under ``tensor``'s bytes; a refusal (an
    old kernel) is ignored: it only leaves them mapped."""
    if _LIBC is None:
        return
    begin = tensor.data_ptr()
    start = -(-begin // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (begin + tensor.numel() * tensor.element_size()) // mmap.PAGESIZE * mmap.PAGESIZE
    if end > start:
        _LIBC.madvise(start, end - start, _MADV_PAGEOUT)


class PeakMemory:
    """How far this process's peak resident memory rose above its resident memory when this
    was made (a tool makes one as it starts its work): transient copies and the mapped pages
    of the rank files included. On Linux this resets the kernel's high-water mark of the
    address space (``/proc/self/clear_refs``) and reads it back (``VmHWM``); ``ru_maxrss``
    would not do, as it also keeps the peak of the parent process it was forked from.
    Elsewhere an earlier peak may hide part of the growth."""

    def __init__(self) -> None:
        # torch imports torch._dynamo (~75 MB of code) the first time a model is built, even
        # on the meta device: importing it first keeps code out of the memory measured here.
        import torch._dynamo  # noqa: F401
        with contextlib.suppress(OSError):
            Path("/proc/self/clear_refs").write_text("5")  # 5: peak := current
        self._start = _peak_rss()

    @property
    def growth(self) -> int:
        """Bytes, never negative: the kernel's page accounting can settle a page below the
        mark read at the start (seen as -4 KiB), which is no growth."""
        return max(0, _peak_rss() - self._start)


def _peak_rss() -> int:
    with contextlib.suppress(OSError), open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    kib_or_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib_or_bytes if sys.platform == "darwin" else kib_or_bytes * 1024


def size_text(nbytes: int) -> str:
    """Bytes for a person, with three significant digits or so: 812 B, 26.0 KiB, 1.25 GiB."""
    value, unit = float(nbytes), "B"
    for bigger in ("KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{nbytes} B" if unit == "B" else f"{value:.{2 if value < 10 else 1}f} {unit}"


def peak_text(growth: int, held: str) -> str:
    """How every checkpoint tool ends its final line: the measured peak (``PeakMemory``) and
    ``held``, what the tool holds at once by design (e.g. "largest tensor 4.0 MiB")."""
    return f"peak memory {size_text(growth)} above the start ({held})"
