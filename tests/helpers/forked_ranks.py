"""Popen-like handles on the ranks ``rank_zygote.py`` forks, read from its report lines.

The ranks are the zygote's children, not ours: their pids come from its ``start R PID``
lines, their exit codes from its ``exit R CODE`` lines (read by one thread), and signals go
straight to the pid. Only what ``launch.Job`` and the tests use: ``pid``, ``returncode``,
``poll``, ``wait``, ``send_signal``, ``kill``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

START_TIMEOUT_S = 120.0  # the zygote's imports, on a loaded 2-core machine
ZYGOTE = Path(__file__).with_name("rank_zygote.py")


class ForkedRank:
    """One rank; ``returncode`` is None until the zygote reported its exit."""

    def __init__(self) -> None:
        self.pid = 0
        self.returncode: int | None = None
        self._ended = threading.Event()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout or 0.0)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):  # ended: its exit line is coming
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def ended_with(self, code: int) -> None:
        self.returncode = code
        self._ended.set()


def _read(zygote: subprocess.Popen, ranks: list[ForkedRank], started: threading.Semaphore,
          other: list[str]) -> None:
    """Follow the zygote's report lines until it exits; keep any other output for errors."""
    for line in zygote.stdout:  # type: ignore[union-attr]
        kind, _, rest = line.partition(" ")
        if kind not in ("start", "exit") or rest.count(" ") != 1:
            other.append(line)
            continue
        rank, value = map(int, rest.split())
        if kind == "start":
            ranks[rank].pid = value
            started.release()
        else:
            ranks[rank].ended_with(value)
    zygote.wait()
    for rank in ranks:  # a zygote that died before forking a rank: that rank never ran
        if not rank.pid:
            rank.ended_with(zygote.returncode or 1)
            started.release()


def start(script: Path, args: list[str], world_size: int, workdir: Path,
          env: dict[str, str]) -> list[ForkedRank]:
    """Fork ``world_size`` ranks of ``script args`` in ``workdir`` (output in rank-R.log);
    return once every rank has started."""
    zygote = subprocess.Popen([sys.executable, str(ZYGOTE), str(world_size), str(script),
                               *args], cwd=workdir, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    ranks = [ForkedRank() for _ in range(world_size)]
    started, other = threading.Semaphore(0), []
    threading.Thread(target=_read, args=(zygote, ranks, started, other), daemon=True,
                     name="rank-zygote").start()
    for _ in ranks:
        if not started.acquire(timeout=START_TIMEOUT_S):
            zygote.kill()
            raise RuntimeError(f"the ranks did not start in {START_TIMEOUT_S:.0f} s")
    if not all(rank.pid for rank in ranks):
        raise RuntimeError("the rank zygote failed:\n" + "".join(other)[-3000:])
    return ranks
