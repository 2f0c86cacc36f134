"""The distributed runner: results by rank, exception forwarding, timeout and cleanup."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from tests.helpers.dist import RankError, run_distributed


def _rank_and_sum(scale: int, *, offset: int) -> tuple[int, int, float, int]:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    rank, size, threads = dist.get_rank(), dist.get_world_size(), torch.get_num_threads()
    return rank, size, t.item() * scale + offset, threads


def _raise_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise ValueError("boom from rank one")
    dist.barrier()  # rank 0 blocks here until the runner kills it


def _hang_on_rank_zero() -> int:
    if dist.get_rank() == 0:
        time.sleep(60)
    return dist.get_rank()


def test_returns_results_indexed_by_rank() -> None:
    results = run_distributed(_rank_and_sum, 3, 2, offset=1)
    assert results == [(r, 3, (1 + 2 + 3) * 2 + 1, 1) for r in range(3)]


def test_forwards_exception_with_rank_and_traceback() -> None:
    with pytest.raises(RankError, match="rank 1 raised ValueError") as info:
        run_distributed(_raise_on_rank_one, 2, timeout_s=60.0)
    assert info.value.rank == 1
    assert "boom from rank one" in info.value.traceback_text
    assert "_raise_on_rank_one" in info.value.traceback_text


def test_timeout_kills_workers() -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks still running: \[0\]"):
        run_distributed(_hang_on_rank_zero, 2, timeout_s=5.0)
    assert time.monotonic() - start < 20.0
