"""The offline reader builds a logical tensor from its chunks only when they tile each TP
rank's slice exactly: sizes that add up are not enough (two chunks of one region would leave
another one unwritten, uninitialised memory read as weights)."""

from __future__ import annotations

import pytest
import torch

from megatron3d.checkpoint.chunks import assemble
from megatron3d.errors import CheckpointError


def _chunk(start: int, end: int, data: torch.Tensor) -> dict:
    return {"name": "w", "kind": "weight", "tp_rank": 0, "tp_size": 1, "local_shape": [2, 4],
            "split_dim": None, "stride": 1, "logical_rows": None, "start": start, "end": end,
            "data": data[start:end]}


def test_chunks_in_any_order_that_tile_the_tensor_assemble_it():
    full = torch.arange(8, dtype=torch.float32)
    chunks = [_chunk(5, 8, full), _chunk(0, 2, full), _chunk(2, 5, full)]
    assert torch.equal(assemble("w", "weight", chunks), full.view(2, 4))


@pytest.mark.parametrize(("ranges", "problem"), [
    ([(0, 4), (0, 4)], "holds overlapping chunks"),  # sizes add up to 8
    ([(0, 4), (2, 6), (6, 6)], "holds overlapping chunks"),
    ([(0, 3), (4, 8)], "has 7 of 8 elements"),
    ([(0, 4)], "has 4 of 8 elements"),
])
def test_overlapping_or_missing_chunks_are_refused(ranges, problem):
    full = torch.arange(8, dtype=torch.float32)
    with pytest.raises(CheckpointError, match=f"w \\(weight\\) of TP rank 0 {problem}"):
        assemble("w", "weight", [_chunk(a, b, full) for a, b in ranges])
