"""What each rank of a row reports: per-step losses and times and its peak RSS, as JSON.

The parent reads one file per rank (``rank{N}.json`` in the row's directory); only ranks
that hold the global loss report losses."""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path


class StepClock:
    """Wall time of each step, from one ``tick`` to the next (the first from ``start``)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._last = time.perf_counter()

    def start(self) -> None:
        self._last = time.perf_counter()

    def tick(self) -> None:
        now = time.perf_counter()
        self.times.append(now - self._last)
        self._last = now


def peak_rss_bytes() -> int:
    """This process's peak resident set (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def write_rank(out_dir: Path, rank: int, losses: list[float] | None,
               times: list[float]) -> None:
    payload = {"rank": rank, "losses": losses, "times": times, "peak_rss": peak_rss_bytes()}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(payload))
