"""Whether chunks of a tensor overlap: the half of "do they tile it exactly" that summing
their sizes cannot see (two chunks over one half add up to the whole while the other half is
never written). Chunks are boxes (offsets, sizes) inside the tensor; with no overlap, they
tile it exactly when their sizes add up to it. Used by the offline reader of our rank files
(``chunks.assemble``) and by the Megatron-Core import (``convert/megatron/coverage.py``).
"""

from __future__ import annotations

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def overlapping(boxes: list[Box]) -> bool:
    """Whether any two non-empty boxes share an element: a sweep along the first axis, so a
    regular grid of chunks costs about one comparison per neighbour, not one per pair."""
    boxes = [b for b in boxes if all(b[1])]
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
