"""What each rank of a row reports: per-step losses and times, its peak RSS, the
collectives of one step and (megatron3d) the bytes of a step from other nodes, as JSON.

The parent reads one file per rank (``rank{N}.json`` in the row's directory); only ranks
that hold the global loss report losses."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import resource
import time
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

from benchmarks.peers.comm_count import CommCounter

COUNTED_STEP = 1
"""The step whose collectives are counted: a warm-up step, so the counter's own cost stays
out of the median; not step 0, which may build buffers or buckets a steady step does not."""
PROFILED_STEP = 2
"""With ``--profile``, the step the profiler watches: also a warm-up step, and not the
counted one, whose dispatch mode would show in the profile."""


class StepClock:
    """Wall time of each step, from one ``tick`` to the next (the first from ``start``);
    around step ``COUNTED_STEP`` it counts collectives and, if asked, around
    ``PROFILED_STEP`` it runs the profiler."""

    def __init__(self, profile_to: Path | None = None) -> None:
        self.times: list[float] = []
        self.counter = CommCounter()
        self._profile_to = profile_to
        self._profiler: profile | None = None
        self._instruments = contextlib.ExitStack()
        self._last = time.perf_counter()

    def start(self) -> None:
        self._observe(0)
        self._last = time.perf_counter()

    def tick(self) -> None:
        now = time.perf_counter()
        self.times.append(now - self._last)
        self._observe(len(self.times))
        self._last = time.perf_counter()

    def _observe(self, next_step: int) -> None:
        self._instruments.close()  # the instrument of the step just done, if any
        if next_step == COUNTED_STEP:
            self._instruments.enter_context(self.counter)
        elif next_step == PROFILED_STEP and self._profile_to is not None:
            self._profiler = self._instruments.enter_context(
                profile(activities=[ProfilerActivity.CPU]))
        elif self._profiler is not None and self._profile_to is not None:
            self._profile_to.write_text(self._profiler.key_averages().table(
                sort_by="self_cpu_time_total", row_limit=40))
            self._profiler.export_chrome_trace(str(self._profile_to.with_suffix(".json")))
            self._profiler = None


def peak_rss_bytes() -> int:
    """This process's peak resident set (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def write_rank(out_dir: Path, rank: int, losses: list[float] | None,
               clock: StepClock, cross_node_bytes: int | None = None) -> None:
    """``cross_node_bytes``: what the rank received from other nodes in a step, where the
    framework counts it (megatron3d's rows)."""
    payload = {"rank": rank, "losses": losses, "times": clock.times,
               "peak_rss": peak_rss_bytes(), "comm": dataclasses.asdict(clock.counter.tally),
               "cross_node_bytes": cross_node_bytes}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(payload))
