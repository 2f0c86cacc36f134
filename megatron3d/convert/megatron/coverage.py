"""Whether the chunks a DCP ``.metadata`` lists for a tensor tile it exactly.

Each saving rank writes its own region of a global tensor, and the reader fills the tensor
from those regions only; a region nobody listed keeps whatever memory the reader allocated.
Summing the chunk sizes is not enough: two chunks over the same half add up to the whole
while the other half is never read. So each chunk must lie inside the tensor, no two may
overlap (``checkpoint/tiling.py``), and together they must hold every element. Pure arithmetic
on the listed offsets and sizes (nothing is read).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from megatron3d.checkpoint.tiling import Box, overlapping


def coverage_problem(name: str, shape: Sequence[int], chunks: Any) -> str | None:
    """What is wrong with ``chunks`` (DCP ``ChunkStorageMetadata``) as a tiling of a tensor
    of ``shape``, in words naming ``name``; None when they tile it exactly."""
    boxes = []
    for chunk in chunks if isinstance(chunks, list) else [None]:
        box = _box(chunk, len(shape))
        if box is None:
            return f"a chunk of {name} is malformed"
        offsets, sizes = box
        if any(o < 0 or s < 0 or o + s > n for o, s, n in zip(offsets, sizes, shape,
                                                              strict=True)):
            return (f"a chunk of {name} lies outside its shape {list(shape)} (at {list(offsets)}"
                    f" of {list(sizes)})")
        if math.prod(sizes):
            boxes.append(box)
    if overlapping(boxes):
        return f"the chunks of {name} overlap"
    if sum(math.prod(sizes) for _, sizes in boxes) != math.prod(shape):
        return f"it holds only part of {name} (a .distcp file lost chunks)"
    return None


def _box(chunk: Any, ndim: int) -> Box | None:
    """(offsets, sizes) of a chunk, or None unless both are ``ndim`` whole numbers."""
    parts = (getattr(chunk, "offsets", None), getattr(chunk, "sizes", None))
    if not all(isinstance(p, tuple) and len(p) == ndim and all(
            type(v) is int for v in p) for p in parts):
        return None
    return parts[0], parts[1]
