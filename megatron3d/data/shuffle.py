"""Seeded permutations that depend on nothing but the seed: not numpy's version, not chunking.

Why not ``numpy.random``: its shuffling algorithms may change between numpy releases, and a
changed shuffle after an upgrade silently changes which samples a resumed run sees. Here each
element gets a 64-bit key from a bijective hash (splitmix64's finaliser) of its position, and a
permutation is the order of the keys. A bijection gives distinct keys, so the order has no ties
and any sort algorithm returns the same permutation.
"""

from __future__ import annotations

import numpy as np

_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)
_ROW_ELEMENTS = 1 << 23  # elements sorted per step in ``permute_rows``: bounds memory


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser: a bijection on uint64 with good avalanche."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9) & _MASK
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB) & _MASK
        return x ^ (x >> np.uint64(31))


def stream_key(seed: int, salt: int) -> np.uint64:
    """A 64-bit key for one named random stream of one seed."""
    with np.errstate(over="ignore"):
        base = _mix(np.array([seed & 0xFFFFFFFFFFFFFFFF], np.uint64))
        return _mix(base + np.uint64(salt & 0xFFFFFFFFFFFFFFFF) * np.uint64(0x9E3779B97F4A7C15))[0]


def keys(key: np.uint64, index: np.ndarray) -> np.ndarray:
    """Distinct pseudo-random uint64 keys for distinct non-negative ``index`` values."""
    return _mix(index.astype(np.uint64) ^ key)


def permute_rows(values: np.ndarray, num_rows: int, key: np.uint64) -> np.ndarray:
    """``num_rows`` independent permutations of ``values``, concatenated: [num_rows * len]."""
    n = len(values)
    out = np.empty(num_rows * n, dtype=values.dtype)
    rows_per_step = max(1, _ROW_ELEMENTS // max(n, 1))
    for first in range(0, num_rows, rows_per_step):
        rows = min(rows_per_step, num_rows - first)
        index = np.arange(first * n, (first + rows) * n, dtype=np.uint64)
        order = np.argsort(keys(key, index).reshape(rows, n), axis=1)
        out[first * n:(first + rows) * n] = values[order].reshape(-1)
    return out


def permute_within_blocks(block: np.ndarray, key: np.uint64) -> np.ndarray:
    """A permutation of ``range(len(block))`` that only moves elements inside their block.

    ``block`` is non-decreasing (block id of each position), so block b's positions stay in
    block b's range and blocks keep their order.
    """
    index = np.arange(len(block), dtype=np.uint64)
    return np.lexsort((keys(key, index), block))
