"""Causal attention work per context-parallel rank, for accounting and benchmarks.

A query at sequence place i attends to i + 1 keys; a rank's work is the sum over the places
it holds, at 4 * d FLOPs per head and visible pair (q k^T and p v, a multiply and an add
each). The 2C-chunk layout gives every rank the same sum; contiguous shards give the last
rank about 2C - 1 times the first's.
"""

from __future__ import annotations

from megatron3d.cp.layout import chunk_size


def attention_flops(seq_length: int, cp_size: int, heads: int, head_dim: int,
                    balanced: bool = True) -> list[int]:
    """Forward attention FLOPs of each CP rank for one sequence: the chunk layout
    (``balanced``) or contiguous shards of seq_length / C."""
    if balanced:
        c = chunk_size(seq_length, cp_size)
        spans = [[(r * c, c), ((2 * cp_size - 1 - r) * c, c)] for r in range(cp_size)]
    else:
        c = seq_length // cp_size
        spans = [[(r * c, c)] for r in range(cp_size)]
    return [4 * heads * head_dim * sum(_pairs(start, length) for start, length in rank)
            for rank in spans]


def imbalance(flops: list[int]) -> float:
    """max / min over ranks: 1.0 is perfect balance."""
    return max(flops) / min(flops)


def _pairs(start: int, length: int) -> int:
    """Visible (query, key) pairs of the queries start .. start + length - 1."""
    return length * start + length * (length + 1) // 2
