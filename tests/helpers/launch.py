"""Start N ranks of a script the way torchrun does, and tear them down the way it does.

For end-to-end tests that need what the spawn helper cannot give: real process exits, exit
codes and signals. Each rank is a process running ``SCRIPT ARGS`` as ``python`` would, with
torchrun's environment variables; when one exits non-zero, the others get ``teardown_s``
seconds and are then killed (torchrun sends SIGTERM and waits 30 s; here the survivors are
killed outright, which also removes a process frozen with SIGSTOP). The ranks are forked from
one process that imported torch for all of them (``rank_zygote.py``: a rank's start is mostly
that import); with ``preexec`` each is its own ``python`` instead.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tests.helpers import forked_ranks
from tests.helpers.forked_ranks import ForkedRank

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Job:
    procs: list[subprocess.Popen] | list[ForkedRank]
    logs: list[Path]
    started: float = field(default_factory=time.monotonic)
    exit_codes: list[int | None] = field(default_factory=list)
    exit_times: list[float | None] = field(default_factory=list)  # monotonic

    def wait(self, timeout_s: float, teardown_s: float = 30.0,
             frozen: tuple[int, ...] = ()) -> int:
        """Wait for every rank; return the job's exit code (first non-zero, else 0).

        ``frozen`` ranks (stopped by the test) are killed as soon as every other rank has
        exited after a failure, instead of waiting out ``teardown_s`` for them."""
        n = len(self.procs)
        self.exit_codes, self.exit_times = [None] * n, [None] * n
        deadline, failed_at = time.monotonic() + timeout_s, None
        while None in self.exit_codes:
            now = time.monotonic()
            for r, p in enumerate(self.procs):
                if self.exit_codes[r] is None and p.poll() is not None:
                    self.exit_codes[r], self.exit_times[r] = p.returncode, now
                    if p.returncode != 0 and failed_at is None:
                        failed_at = now
            live_done = all(c is not None for r, c in enumerate(self.exit_codes)
                            if r not in frozen)
            if now > deadline or (failed_at is not None
                                  and (now > failed_at + teardown_s or live_done)):
                self.kill()
                break
            time.sleep(0.1)
        failures = [c for c in self.exit_codes if c]
        return failures[0] if failures else (0 if None not in self.exit_codes else -9)

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
                p.wait()

    def output(self, rank: int) -> str:
        return self.logs[rank].read_text(errors="replace")


def launch(script: str, args: list[str], world_size: int, workdir: Path,
           env: dict[str, str] | None = None,
           preexec: Callable[[], None] | None = None) -> Job:
    """Start ``world_size`` ranks of ``python script args``; output goes to workdir/rank-R.log.
    ``preexec`` runs in each child before the script (e.g. to set a resource limit)."""
    port = _free_port()
    job_env = {**os.environ, **(env or {}), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "WORLD_SIZE": str(world_size),
               "LOCAL_WORLD_SIZE": str(world_size), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": str(ROOT)}
    logs = [workdir / f"rank-{rank}.log" for rank in range(world_size)]
    if preexec is None:
        started = time.monotonic()  # a job's time counts its ranks' start, as before
        return Job(forked_ranks.start(ROOT / script, args, world_size, workdir, job_env), logs,
                   started)
    procs = []
    for rank, log in enumerate(logs):
        with open(log, "w") as out:
            procs.append(subprocess.Popen(
                [sys.executable, str(ROOT / script), *args], cwd=workdir, stdout=out,
                env={**job_env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                stderr=subprocess.STDOUT, preexec_fn=preexec))
    return Job(procs, logs)
