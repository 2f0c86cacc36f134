"""Whether the chunks a DCP ``.metadata`` lists for a tensor tile it exactly.

Each saving rank writes its own region of a global tensor, and the reader fills the tensor
from those regions only; a region nobody listed keeps whatever memory the reader allocated.
Summing the chunk sizes is not enough: two chunks over the same half add up to the whole
while the other half is never read. So each chunk must lie inside the tensor, no two may
overlap, and together they must hold every element. Pure arithmetic on the listed offsets and
sizes (nothing is read), sweeping the chunks in order of their first offset so that a
regular grid of chunks costs about one comparison per neighbour, not one per pair.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


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
    if _overlapping(boxes):
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


def _overlapping(boxes: list[Box]) -> bool:
    """Whether any two non-empty boxes share an element (a sweep along the first axis)."""
    if boxes and not boxes[0][0]:  # a scalar: more than one chunk is an overlap
        return len(boxes) > 1
    active: list[Box] = []
    for box in sorted(boxes):
        start = box[0][0]
        active = [a for a in active if a[0][0] + a[1][0] > start]
        if any(_meet(box, other) for other in active):
            return True
        active.append(box)
    return False


def _meet(a: Box, b: Box) -> bool:
    """Whether two boxes share an element: their ranges intersect along every axis."""
    return all(oa < ob + sb and ob < oa + sa
               for oa, sa, ob, sb in zip(a[0], a[1], b[0], b[1], strict=True))
