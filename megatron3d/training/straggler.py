"""Straggler naming: the rank that computes its steps persistently slower than its peers.

Why: synchronous training waits for its slowest rank at every collective, so one slow device or
host slows the whole job while every rank's step time looks the same. Each rank therefore
times its own compute, the pipeline engine's forward and backward passes of each step
(``device.ComputeSpans``), without a sync: on CUDA with events, read at the log line where the
device is synced already; on CPU by the training thread's CPU time. Not the wall clock, which
counts the time blocked in collectives and, on CPU, the time other processes held the cores
(4 ranks on 2 shared cores: healthy ranks' 5-step windows spread by up to 110% in wall time,
20% in thread time); not the process's CPU time, which counts gloo's background threads
(torch's intra-op threads are left out too, alike on every rank). The span leaves out the
gradient reductions and the optimizer's collectives waited for after the passes; it includes
what the passes themselves wait on (pipeline receives, ZeRO-3 parameter gathers), which is why
a rank is compared only with its peers, the other ranks of its pipeline stage: they run the
same layers and wait alike. A rank without peers (one rank per stage) is compared with nobody.

At the first log line at least ``--straggler-interval`` iterations after the previous
comparison, every rank all-gathers its median compute time per step over the window (one
number each: the same single collective, at the same iteration, on every rank); the median,
not the mean, so that one step held up (a garbage collection, a page fault) is not a slow
window. The same rule then runs on every rank: a rank slower than the median of its peers by
more than ``--straggler-threshold`` in ``PERSISTENCE`` comparisons in a row is named, at each
comparison while it stays slow; one noisy window never names anyone. The named rank logs the
warning itself (its node name is its own to know); the logging rank writes every rank's
slowdown to TensorBoard.
"""

from __future__ import annotations

import socket
import statistics
from collections.abc import Sequence

import torch

from megatron3d import device as devices
from megatron3d.checkpoint.progress import Progress
from megatron3d.log import get_logger
from megatron3d.mpu import comm
from megatron3d.mpu.state import AxisGroup
from megatron3d.training.tensorboard import TensorBoardWriter

logger = get_logger(__name__)

PERSISTENCE = 3
"""Comparisons in a row a rank must be slow in before it is named: with the default interval,
300 steps; a transient blip of one window (or two) is not a straggler."""


def stage_peers(world_size: int, pp_size: int) -> list[list[int]]:
    """For each rank, the other ranks of its pipeline stage (Megatron's rank order puts a
    stage's ranks next to each other: ``world_size // pp_size`` of them)."""
    per_stage = world_size // pp_size
    return [[p for p in range(r - r % per_stage, r - r % per_stage + per_stage) if p != r]
            for r in range(world_size)]


def slowdowns(times: Sequence[float], peers: Sequence[Sequence[int]]) -> list[float | None]:
    """Each rank's time over the median of its peers', less one (0.5: 50% slower); None for
    a rank without peers or whose peers measured nothing."""
    out: list[float | None] = []
    for rank, time in enumerate(times):
        median = statistics.median(times[p] for p in peers[rank]) if peers[rank] else 0.0
        out.append(time / median - 1.0 if median > 0 else None)
    return out


class StragglerRule:
    """Which ranks to name after each comparison: those slower than ``threshold`` in the last
    ``persistence`` comparisons, each of them."""

    def __init__(self, threshold: float, persistence: int = PERSISTENCE) -> None:
        self.threshold, self.persistence = threshold, persistence
        self._streaks: dict[int, int] = {}

    def judge(self, slower: Sequence[float | None]) -> list[int]:
        named = []
        for rank, by in enumerate(slower):
            slow = by is not None and by > self.threshold
            self._streaks[rank] = self._streaks.get(rank, 0) + 1 if slow else 0
            if self._streaks[rank] >= self.persistence:
                named.append(rank)
        return named


class StragglerWatch:
    """Times this rank's compute (``spans``, which ``train_step`` marks), compares the ranks at
    log lines (``at_log_line``) and names stragglers; ``interval`` 0 turns it off."""

    def __init__(self, interval: int, threshold: float, world: AxisGroup,
                 peers: list[list[int]], dev: torch.device, writer: TensorBoardWriter) -> None:
        self.interval, self.world, self.peers = interval, world, peers
        self.device, self.writer = dev, writer
        self.spans = devices.ComputeSpans(dev) if interval else None
        self._rule = StragglerRule(threshold)
        self._since = 0  # the iteration the current window starts after

    def start(self, iteration: int) -> None:
        """Training starts (or resumes) after ``iteration``: the first window begins here."""
        self._since = iteration

    def at_log_line(self, at: Progress) -> None:
        """Compare the ranks if a window is complete; the device has just been synced."""
        if self.spans is None or at.iteration - self._since < self.interval:
            return
        steps = self.spans.take()
        typical = statistics.median(steps) if steps else 0.0
        mine = torch.tensor([typical], dtype=torch.float32, device=self.device)
        times = comm.all_gather(mine, self.world, 0).tolist()
        slower = slowdowns(times, self.peers)
        self.writer.write({f"straggler slowdown rank {rank}": by
                           for rank, by in enumerate(slower)}, at)
        named = self._rule.judge(slower)
        if self.world.rank in named:
            self._warn(times, slower, at.iteration)
        self._since = at.iteration

    def _warn(self, times: list[float], slower: list[float | None], iteration: int) -> None:
        me = self.world.rank
        peers = [times[p] for p in self.peers[me]]
        logger.warning(
            "straggler: rank %d on node %s computes its steps %.0f%% slower than the median of "
            "its %d peers (median %.1f ms vs %.1f ms per step, iterations %d-%d), above "
            "--straggler-threshold %g in %d comparisons in a row", me, socket.gethostname(),
            100 * slower[me], len(peers), 1000 * times[me], 1000 * statistics.median(peers),
            self._since + 1, iteration, self._rule.threshold, self._rule.persistence)
