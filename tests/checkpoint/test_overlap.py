"""Copying the overlaps of saved chunks into another layout's pieces gives what cutting the
logical tensor for that layout gives (``chunks.tp_slice``), for every way a slice is cut:
along rows or columns, strided (SwiGLU), a padded vocabulary table, replicated."""

from __future__ import annotations

import random

import pytest
import torch

from megatron3d.checkpoint import overlap
from megatron3d.checkpoint.chunks import tp_slice
from megatron3d.checkpoint.overlap import FilePages, Geometry, copy_box, shared, size
from megatron3d.mpu.meta import ParamMeta

# (logical shape, split dim, stride, logical rows): each divisible by TP 1, 2 and 4.
TENSORS = {
    "rows": ((16, 6), 0, 1, None),
    "columns": ((3, 16, 2), 1, 1, None),
    "swiglu": ((16, 5), 0, 2, None),
    "vocabulary": ((13, 4), 0, 1, 13),
    "replicated": ((7, 3), None, 1, None),
    "large": ((512, 3, 64), 2, 1, None),  # spans pages, which copies give back as they go
}


def _padded(rows: int, tp: int) -> int:
    return -(-rows // (8 * tp)) * 8 * tp  # the padded vocabulary of that TP size


def _cuts(n: int, rng: random.Random) -> list[tuple[int, int]]:
    """[0, n) cut into random ranges (ZeRO pieces, saved chunks)."""
    points = sorted({0, n, *(rng.randrange(n + 1) for _ in range(rng.randrange(4)))})
    return list(zip(points, points[1:], strict=False))


@pytest.mark.parametrize("name", list(TENSORS))
@pytest.mark.parametrize(("saved_tp", "target_tp"), [(1, 4), (2, 4), (4, 2), (2, 1), (2, 2)])
@pytest.mark.parametrize("block", [overlap.BLOCK, 700])
def test_overlaps_rebuild_any_layouts_slice(tmp_path, monkeypatch, name, saved_tp, target_tp,
                                            block):
    monkeypatch.setattr(overlap, "BLOCK", block)
    shape, split, stride, rows = TENSORS[name]
    meta = ParamMeta(name, tp_split_dim=split, tp_stride=stride, logical_rows=rows)
    logical = torch.randn(shape)
    saved_rows, target_rows = (_padded(shape[0], t) for t in (saved_tp, target_tp))
    rng = random.Random(f"{name}{saved_tp}{target_tp}")
    tp_ranks = range(saved_tp if split is not None else 1)
    chunks = []  # (tp rank, start, end, data): each saved slice cut at random
    for t in tp_ranks:
        local = tp_slice(logical, meta, t, saved_tp, saved_rows).reshape(-1)
        chunks += [(t, a, b, local[a:b].clone()) for a, b in _cuts(local.numel(), rng)]
    path = tmp_path / "chunks.pt"
    torch.save([c[3] for c in chunks], path)
    mapped = torch.load(path, mmap=True, weights_only=True)  # as rank files are read
    pages = FilePages(path)
    assert pages.ranges
    for t in range(target_tp if split is not None else 1):
        expected = tp_slice(logical, meta, t, target_tp, target_rows)
        mine = Geometry.of(tuple(expected.shape), split, stride, rows, t, target_tp)
        got = torch.zeros(expected.numel())
        for start, end in _cuts(expected.numel(), rng):
            wanted = mine.boxes(start, end)
            copied = 0
            for (tp_rank, a, b, _), data in zip(chunks, mapped, strict=True):
                theirs = Geometry.of(tuple(tp_slice(logical, meta, tp_rank, saved_tp,
                                                    saved_rows).shape),
                                     split, stride, rows, tp_rank, saved_tp)
                for x in wanted:
                    for y in theirs.boxes(a, b):
                        if (box := shared(x, y, mine.real)) is not None:
                            copy_box(got, mine, 0, data, theirs, a, box, pages)
                            copied += size(box)
            assert copied == sum(size(b) for x in wanted if (b := shared(x, x, mine.real)))
        assert torch.equal(got, expected.reshape(-1)), (name, t)
