"""The hang watchdog: a thread per rank that turns a stalled job into dumps and an exit.

A hung collective blocks the main thread inside C code, where Python signal handlers and
timers cannot run; so the watchdog is its own thread. If no step finishes within the
allowance (``--hang-timeout`` between steps; ``--hang-startup-timeout`` during start-up,
checkpoint load and save, evaluation and until the first step), it writes this rank's dump
(``hang_dump.py``), waits a few seconds so that the other ranks, whose watchdogs fire at about
the same moment, can write theirs before connections drop, then exits the process with
``HANG_EXIT_CODE`` so the launcher tears the job down.

SIGUSR2 writes the same dump without stopping. Python runs signal handlers only on the main
thread, which may be the blocked one, so the signal reaches this thread through
``signal.set_wakeup_fd``: the interpreter's C-level handler writes the signal number to a pipe
that the watchdog thread waits on.
"""

from __future__ import annotations

import contextlib
import math
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from megatron3d.config import TrainConfig
from megatron3d.log import get_logger
from megatron3d.mpu.state import ParallelState
from megatron3d.resilience.failure_board import PEER_EXIT_CODE, FailureBoard
from megatron3d.resilience.flight_recorder import FlightRecorder
from megatron3d.resilience.hang_dump import dump_path, write_dump

logger = get_logger(__name__)

HANG_EXIT_CODE = 3
DUMP_SIGNAL = signal.SIGUSR2
EXIT_GRACE_S = 5.0  # after dumping, before exiting: the peers' watchdogs fire meanwhile
_POLL_S = 1.0
_BOARD_POLL_S = 3.0  # one store lookup per rank this often: cheap for the store's host


class Watchdog:
    """``start()`` on the main thread, ``beat()`` after every step, ``allowance()`` around
    long non-step work, ``stop()`` at the end. ``timeout`` 0: dumps on SIGUSR2 only."""

    def __init__(self, recorder: FlightRecorder, dump_dir: Path, rank: int,
                 sizes: dict[str, int], coords: dict[str, int], timeout: float,
                 startup_timeout: float, board: FailureBoard | None = None) -> None:
        """``sizes``/``coords``: the (tp, pp, dp) layout and this rank's place in it;
        ``board``: where a failing peer posts, checked every few seconds."""
        self.recorder = recorder
        self.path = dump_path(dump_dir, rank)
        self.rank, self.sizes, self.coords = rank, sizes, coords
        self.timeout, self.startup_timeout = timeout, startup_timeout
        self.iteration = 0  # last finished step
        self.phase = "start-up (until the first step finishes)"
        self._deadline = time.monotonic() + startup_timeout
        self._allowance = startup_timeout
        self._stepped = False
        self.fired = False  # a hang dump was written: later dumps must not replace it
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pipe: tuple[int, int] | None = None
        self._previous: tuple[int, object] | None = None
        self.board = board

    @classmethod
    def for_run(cls, cfg: TrainConfig, state: ParallelState,
                recorder: FlightRecorder, board: FailureBoard | None = None) -> Watchdog:
        r = cfg.resilience
        return cls(recorder, default_dump_dir(r.hang_dump_dir, cfg.checkpoint.save),
                   state.world_rank,
                   {"tp": state.tp.size, "pp": state.pp.size, "dp": state.dp.size},
                   {"tp": state.tp.rank, "pp": state.pp.rank, "dp": state.dp.rank},
                   r.hang_timeout, r.hang_startup_timeout, board)

    # -- main thread ------------------------------------------------------------------------
    def start(self) -> Watchdog:
        """Install the SIGUSR2 route and start the thread; removes this rank's stale dump."""
        self.path.unlink(missing_ok=True)
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        self._pipe = (read_fd, write_fd)
        wakeup = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        self._previous = (wakeup, signal.signal(DUMP_SIGNAL, _ignore))
        self._thread = threading.Thread(target=self._watch, name="megatron3d-watchdog",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        os.write(self._pipe[1], b"\0")  # wake the thread now
        self._thread.join()
        wakeup, handler = self._previous
        signal.set_wakeup_fd(wakeup)
        signal.signal(DUMP_SIGNAL, handler)
        for fd in self._pipe:
            os.close(fd)
        self._thread = None

    def starting(self, iteration: int) -> None:
        """Training begins after ``iteration`` finished steps (non-zero after a resume)."""
        self.iteration = iteration
        self.recorder.iteration = iteration + 1

    def beat(self, iteration: int) -> None:
        """A step finished: the next one gets ``timeout`` seconds."""
        self.iteration = iteration
        self.recorder.iteration = iteration + 1
        self._stepped = True
        self.phase = "training"
        self._allowance = self.timeout
        self._deadline = time.monotonic() + self.timeout

    @contextlib.contextmanager
    def allowance(self, phase: str) -> Iterator[None]:
        """Work that may legitimately take longer than a step (save, evaluation)."""
        previous = self.phase
        self.phase, self._allowance = phase, self.startup_timeout
        self._deadline = time.monotonic() + self.startup_timeout
        try:
            yield
        finally:
            self.phase = previous
            self._allowance = self.timeout if self._stepped else self.startup_timeout
            self._deadline = time.monotonic() + self._allowance

    def dump(self, reason: str) -> Path:
        """Write this rank's dump now (any thread)."""
        write_dump(self.path, {
            "reason": reason, "rank": self.rank, "world_size": math.prod(self.sizes.values()),
            "sizes": self.sizes, "coords": self.coords, "iteration": self.iteration,
            "phase": self.phase,
            "job": os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID", ""),
        }, self.recorder.snapshot())
        return self.path

    # -- watchdog thread --------------------------------------------------------------------
    def _watch(self) -> None:
        read_fd = self._pipe[0]
        next_board_check = time.monotonic() + _BOARD_POLL_S
        while not self._stop.is_set():
            ready, _, _ = select.select([read_fd], [], [], _POLL_S)
            if ready and DUMP_SIGNAL in os.read(read_fd, 64):
                path = self.dump(f"{DUMP_SIGNAL.name} (on request; training continues)")
                logger.info("rank %d wrote %s on %s", self.rank, path, DUMP_SIGNAL.name)
            if self.timeout > 0 and time.monotonic() > self._deadline and not self._stop.is_set():
                self._fire()
            if self.board is not None and time.monotonic() > next_board_check:
                next_board_check = time.monotonic() + _BOARD_POLL_S
                if self.board.stop_for_peer() and not self._stop.is_set():
                    os._exit(PEER_EXIT_CODE)  # the main thread is blocked in a collective

    def _fire(self) -> None:
        waited = self._allowance
        self.fired = True
        path = self.dump(f"no progress for {waited:g} s during {self.phase} "
                         f"(--hang-timeout / --hang-startup-timeout)")
        sys.stderr.write(f"error: rank {self.rank} {self._where()}: nothing finished for "
                         f"{waited:g} s during {self.phase}; wrote {path}; run "
                         f"tools/hang_report.py {path.parent} to see which ranks stopped "
                         f"where; exiting with code {HANG_EXIT_CODE}\n")
        sys.stderr.flush()
        time.sleep(EXIT_GRACE_S)
        os._exit(HANG_EXIT_CODE)

    def _where(self) -> str:
        return "(" + ", ".join(f"{k} {v}" for k, v in self.coords.items()) + ")"


def _ignore(signum: int, frame: object) -> None:
    """SIGUSR2's Python handler does nothing: the wakeup pipe carries it to the watchdog."""


def default_dump_dir(dump_dir: str | None, save: str | None) -> Path:
    """--hang-dump-dir, else SAVE/hang, else ./hang."""
    if dump_dir:
        return Path(dump_dir)
    return Path(save) / "hang" if save else Path("hang")
