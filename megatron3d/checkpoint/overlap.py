"""Where part of one TP rank's slice of a logical tensor lies in that tensor, and the copy of
the elements two such parts share, without ever building the logical tensor.

``tp_shard`` cuts a logical tensor along ``split_dim`` into ``stride`` sub-matrices and each
of those into ``tp_size`` parts. Seen flat, a TP rank's slice is therefore ``groups`` runs of
``width`` elements (groups: the elements before ``split_dim`` times ``stride``), run g being
elements [rank * width, (rank + 1) * width) of group g of the logical tensor, whose groups
hold ``width * tp_size`` elements each. A flat range of a slice (a ZeRO piece, a saved
chunk) is then at most three boxes, groups [g0, g1) x group elements [z0, z1), and two
layouts of one tensor share exactly the intersections of their boxes, each copied as one
strided [groups, elements] view. A vocabulary table is a single group whose padding rows,
past ``real`` elements, depend on the layout: they are never copied.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import mmap
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

Box = tuple[int, int, int, int]  # groups [g0, g1) x group elements [z0, z1)

# Elements of a source read between two releases of its pages (4 MiB of fp32).
BLOCK = 1 << 20

_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
if _LIBC is not None:
    _LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def logical_shape(local_shape: tuple[int, ...], split_dim: int | None, tp_size: int,
                  logical_rows: int | None) -> tuple[int, ...]:
    """The logical tensor's shape (vocabulary padding dropped) from one TP slice's."""
    shape = list(local_shape)
    if split_dim is not None:
        shape[split_dim] *= tp_size
    if logical_rows is not None:
        shape[0] = logical_rows
    return tuple(shape)


@dataclass(frozen=True)
class Geometry:
    """How one TP rank's slice of a logical tensor sits in it (see the module docstring)."""

    groups: int
    width: int  # elements of a group held by one TP rank
    rank: int  # the TP rank (0 for a replicated tensor)
    real: int  # elements of a group that are not vocabulary padding

    @classmethod
    def of(cls, local_shape: tuple[int, ...], split_dim: int | None, stride: int,
           logical_rows: int | None, tp_rank: int, tp_size: int) -> Geometry:
        """The slice of TP rank ``tp_rank`` of ``tp_size`` (its shape ``local_shape``)."""
        if split_dim is None:
            groups, tp_rank, tp_size = 1, 0, 1
        else:
            groups = math.prod(local_shape[:split_dim]) * stride
        width = math.prod(local_shape) // groups
        real = width * tp_size
        if logical_rows is not None:
            assert groups == 1, "a vocabulary table is split along its rows, unstrided"
            real = logical_rows * math.prod(local_shape[1:])
        return cls(groups, width, tp_rank, real)

    def boxes(self, start: int, end: int) -> list[Box]:
        """Flat elements [start, end) of the slice: a partial run, whole runs, a partial
        run (padding included; ``shared`` drops it)."""
        found, base = [], self.rank * self.width
        while start < end:
            group, offset = divmod(start, self.width)
            whole = (end - start) // self.width if offset == 0 else 0
            if whole:
                found.append((group, group + whole, base, base + self.width))
                start += whole * self.width
            else:
                stop = min(end, (group + 1) * self.width)
                found.append((group, group + 1, base + offset, base + stop - group * self.width))
                start = stop
        return found

    def view(self, flat: torch.Tensor, origin: int, box: Box) -> torch.Tensor:
        """``box`` as a [groups, elements] view of ``flat``, which holds the slice's flat
        elements from ``origin`` on (``flat[i]`` is element ``origin + i``)."""
        g0, g1, z0, z1 = box
        first = g0 * self.width + z0 - self.rank * self.width - origin
        span = (g1 - g0 - 1) * self.width + z1 - z0
        return flat[first:first + span].unfold(0, z1 - z0, self.width)


def shared(a: Box, b: Box, real: int) -> Box | None:
    """The elements of both boxes that are not padding, or None."""
    g0, g1 = max(a[0], b[0]), min(a[1], b[1])
    z0, z1 = max(a[2], b[2]), min(a[3], b[3], real)
    return (g0, g1, z0, z1) if g0 < g1 and z0 < z1 else None


def size(box: Box) -> int:
    return (box[1] - box[0]) * (box[3] - box[2])


class FilePages:
    """Where this process maps the file ``path`` (``/proc/self/maps``, Linux; nowhere
    elsewhere), so that copies can give back the pages they read: the pages of a mapped rank
    file stay resident until it is closed, up to the bytes a rank loads. ``MADV_DONTNEED``
    drops them from this process only; the file is mapped private and never written, so a
    page read again comes back from the file (the page cache, still warm for other ranks:
    ``MADV_PAGEOUT`` would evict it). Pages outside the file's mappings are never touched:
    on anonymous memory the advice would discard data."""

    def __init__(self, path: Path) -> None:
        self.ranges: list[tuple[int, int]] = []
        with contextlib.suppress(OSError), open("/proc/self/maps") as maps:
            real = os.path.realpath(path)
            for line in maps:
                fields = line.rstrip("\n").split(maxsplit=5)
                if len(fields) == 6 and fields[5] == real:
                    low, high = fields[0].split("-")
                    self.ranges.append((int(low, 16), int(high, 16)))

    def release(self, view: torch.Tensor) -> None:
        """Give back every page ``view`` touches (the file's, so a page it shares with a
        neighbouring chunk is only read again if that one needs it)."""
        if _LIBC is None or view.numel() == 0:
            return
        begin = view.data_ptr()
        last = sum((n - 1) * s for n, s in zip(view.shape, view.stride(), strict=True))
        end = begin + (last + 1) * view.element_size()
        for low, high in self.ranges:  # page-aligned
            start = max(begin // mmap.PAGESIZE * mmap.PAGESIZE, low)
            stop = min(-(-end // mmap.PAGESIZE) * mmap.PAGESIZE, high)
            if stop > start:
                _LIBC.madvise(start, stop - start, mmap.MADV_DONTNEED)


def copy_box(dst: torch.Tensor, dst_geometry: Geometry, dst_origin: int, src: torch.Tensor,
             src_geometry: Geometry, src_origin: int, box: Box, pages: FilePages) -> None:
    """Copy ``box`` from ``src`` into ``dst`` (see ``Geometry.view`` for the origins), about
    ``BLOCK`` source elements at a time, giving back the pages of ``src`` that lie in
    ``pages`` after each block."""
    for part in _blocks(box, src_geometry.width):
        source = src_geometry.view(src, src_origin, part)
        dst_geometry.view(dst, dst_origin, part).copy_(source)
        pages.release(source)


def _blocks(box: Box, src_width: int) -> Iterator[Box]:
    g0, g1, z0, z1 = box
    if z1 - z0 >= BLOCK:
        for g in range(g0, g1):
            for z in range(z0, z1, BLOCK):
                yield g, g + 1, z, min(z + BLOCK, z1)
        return
    rows = max(1, BLOCK // src_width)
    for g in range(g0, g1, rows):
        yield g, min(g + rows, g1), z0, z1
