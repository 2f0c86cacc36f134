"""The hang watchdog: a thread per rank that turns a stalled job into dumps and an exit.

A hung collective blocks the main thread inside C code, where Python signal handlers and
timers cannot run; so the watchdog is its own thread. If no step finishes within the
allowance (``--hang-timeout`` between steps; each phase in ``PHASES`` its own, e.g.
``--hang-load-timeout``), it writes this rank's dump (``hang_dump.py``) and, on NCCL, torch's
own flight-recorder trace beside it, waits a few seconds so that the other ranks, whose
watchdogs fire at about the same moment, can write theirs before connections drop, then exits
the process with ``HANG_EXIT_CODE`` so the launcher tears the job down. Every allowance is
below the process group's timeout (``validation.py``), so the watchdog fires first.

The thread also polls the flight recorder a few times a second: which posted operations
completed (off the training thread, and it lets go of their works).

SIGUSR2 writes the same dump without stopping. Python runs signal handlers only on the main
thread, which may be the blocked one, so the signal reaches this thread through
``signal.set_wakeup_fd``: the interpreter's C-level handler writes the signal number to a pipe
that the watchdog thread waits on. SIGTERM comes the same way (under ``--save`` the exit
watch's handler catches it): a rank that then stays blocked in a collective exits
(``term_grace.py``).
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
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from megatron3d import device as devices
from megatron3d.config import TrainConfig
from megatron3d.log import get_logger
from megatron3d.mpu.state import ParallelState
from megatron3d.resilience.failure_board import PEER_EXIT_CODE, FailureBoard
from megatron3d.resilience.flight_recorder import FlightRecorder
from megatron3d.resilience.hang_dump import dump_path, write_dump
from megatron3d.resilience.term_grace import TERM_EXIT_CODE, TermGrace

logger = get_logger(__name__)

HANG_EXIT_CODE = 3
DUMP_SIGNAL = signal.SIGUSR2
EXIT_GRACE_S = 5.0  # after dumping, before exiting: the peers' watchdogs fire meanwhile
_POLL_S = 0.1  # a completed work is let go of (its tensors freed) at most this late
_BOARD_POLL_S = 3.0  # one store lookup per rank this often: cheap for the store's host
STARTUP = "start-up (until the first step finishes)"
PHASES = {  # what may take longer than a step -> its allowance, ResilienceConfig.budget's name
    STARTUP: "first_step", "dataset index building": "index", "checkpoint load": "load",
    "checkpoint save": "save", "evaluation": "eval"}


class Watchdog:
    """``start()`` on the main thread, ``beat()`` after every step, ``allowance()`` around
    long non-step work, ``stop()`` at the end. ``timeout`` 0: dumps on SIGUSR2 only."""

    def __init__(self, recorder: FlightRecorder, dump_dir: Path, rank: int,
                 sizes: dict[str, int], coords: dict[str, int], timeout: float,
                 budgets: Mapping[str, float], board: FailureBoard | None = None,
                 trace: Callable[[], Path] | None = None) -> None:
        """``sizes``/``coords``: the (tp, pp, dp) layout and this rank's place in it;
        ``budgets``: seconds for each of ``PHASES``; ``board``: where a failing peer posts,
        checked every few seconds; ``trace``: writes the backend's own trace beside a dump."""
        self.recorder = recorder
        self.path = dump_path(dump_dir, rank)
        self.rank, self.sizes, self.coords = rank, sizes, coords
        self.timeout, self.budgets = timeout, {phase: budgets[phase] for phase in PHASES}
        self.trace = trace
        self.iteration = 0  # last finished step
        self.phase = STARTUP
        self._limit = _limit(STARTUP, self.budgets[STARTUP])
        self._stepped = False
        self.fired = False  # a hang dump was written: later dumps must not replace it
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pipe: tuple[int, int] | None = None
        self._previous: tuple[int, object] | None = None
        self.board = board
        self.term = TermGrace()

    @classmethod
    def for_run(cls, cfg: TrainConfig, state: ParallelState,
                recorder: FlightRecorder, board: FailureBoard | None = None) -> Watchdog:
        r = cfg.resilience
        directory = default_dump_dir(r.hang_dump_dir, cfg.checkpoint.save)
        return cls(recorder, directory, state.world_rank,
                   _axes(state, lambda axis: axis.size), _axes(state, lambda axis: axis.rank),
                   r.hang_timeout, {phase: r.budget(name) for phase, name in PHASES.items()},
                   board, devices.backend_trace_writer(directory, state.world_rank))

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
        self._limit = _limit("training", self.timeout)

    @contextlib.contextmanager
    def allowance(self, phase: str) -> Iterator[None]:
        """Work that may legitimately take longer than a step: one of ``PHASES``, with its own
        budget. Afterwards the step's (before the first step, start-up's) counts afresh, but
        never ends before the phase's would have: a rank done early then waits in a
        collective for the peers still in that phase (a slower load, a bigger index)."""
        previous = self.phase
        self.phase = phase
        self._limit = within_phase = _limit(phase, self.budgets[phase])
        try:
            yield
        finally:
            self.phase = previous
            after = (_limit("training", self.timeout) if self._stepped
                     else _limit(STARTUP, self.budgets[STARTUP]))
            self._limit = max(within_phase, after)

    def dump(self, reason: str) -> Path:
        """Write this rank's dump now, and the backend's trace beside it (any thread)."""
        write_dump(self.path, {
            "reason": reason, "rank": self.rank, "world_size": math.prod(self.sizes.values()),
            "sizes": self.sizes, "coords": self.coords, "iteration": self.iteration,
            "phase": self.phase,
            "job": os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID", ""),
        }, self.recorder.snapshot())
        if self.trace is not None:
            try:
                logger.info("rank %d wrote the backend's trace to %s", self.rank, self.trace())
            except (RuntimeError, OSError) as err:  # ours is written: report, never raise
                logger.warning("rank %d could not write the backend's trace: %s", self.rank,
                               err)
        return self.path

    # -- watchdog thread --------------------------------------------------------------------
    def _watch(self) -> None:
        read_fd = self._pipe[0]
        next_board_check = time.monotonic() + _BOARD_POLL_S
        while not self._stop.is_set():
            ready, _, _ = select.select([read_fd], [], [], _POLL_S)
            self.recorder.poll()
            signals = os.read(read_fd, 64) if ready else b""
            if DUMP_SIGNAL in signals:
                path = self.dump(f"{DUMP_SIGNAL.name} (on request; training continues)")
                logger.info("rank %d wrote %s on %s", self.rank, path, DUMP_SIGNAL.name)
            if signal.SIGTERM in signals:
                self.term.signalled(time.monotonic())
            if self.term.expired(time.monotonic(), self.recorder.activity(),
                                 saving=self.phase == "checkpoint save") \
                    and not self._stop.is_set():
                self._end_on_term()
            if self.timeout > 0 and time.monotonic() > self._limit[0] and not self._stop.is_set():
                self._fire()
            if self.board is not None and time.monotonic() > next_board_check:
                next_board_check = time.monotonic() + _BOARD_POLL_S
                if self.board.stop_for_peer() and not self._stop.is_set():
                    os._exit(PEER_EXIT_CODE)  # the main thread is blocked in a collective

    def _fire(self) -> None:
        _, waited, flag = self._limit
        self.fired = True
        path = self.dump(f"no progress for {waited:g} s during {self.phase} ({flag})")
        sys.stderr.write(f"error: rank {self.rank} {self._where()}: nothing finished for "
                         f"{waited:g} s during {self.phase} ({flag}); wrote {path}; run "
                         f"tools/hang_report.py {path.parent} to see which ranks stopped "
                         f"where; exiting with code {HANG_EXIT_CODE}\n")
        sys.stderr.flush()
        time.sleep(EXIT_GRACE_S)
        os._exit(HANG_EXIT_CODE)

    def _end_on_term(self) -> None:
        """SIGTERM came and this rank stays blocked on a peer: it cannot save, so it ends."""
        sys.stderr.write(f"rank {self.rank} {self._where()}: SIGTERM while waiting in a "
                         f"collective with nothing finishing for {self.term.grace_s:g} s (a "
                         "peer is gone): exiting now without saving, with code "
                         f"{TERM_EXIT_CODE}\n")
        sys.stderr.flush()
        os._exit(TERM_EXIT_CODE)

    def _where(self) -> str:
        return "(" + ", ".join(f"{k} {v}" for k, v in self.coords.items()) + ")"


def _limit(phase: str, seconds: float) -> tuple[float, float, str]:
    """(deadline, the allowance, its flag) for ``phase`` starting now: one tuple, swapped
    whole, so that the watchdog thread never reads half of an update."""
    name = PHASES.get(phase)
    flag = "--hang-timeout" if name is None else f"--hang-{name.replace('_', '-')}-timeout"
    return time.monotonic() + seconds, seconds, flag


def _ignore(signum: int, frame: object) -> None:
    """SIGUSR2's Python handler does nothing: the wakeup pipe carries it to the watchdog."""


def default_dump_dir(dump_dir: str | None, save: str | None) -> Path:
    """--hang-dump-dir, else SAVE/hang, else ./hang."""
    if dump_dir:
        return Path(dump_dir)
    return Path(save) / "hang" if save else Path("hang")


def _axes(state: ParallelState, value: Callable) -> dict[str, int]:
    """``value`` of each axis a hang dump names this rank by: tp, pp, dp, and cp when the run
    splits sequences."""
    axes = {"tp": state.tp, "pp": state.pp, "dp": state.dp}
    if state.cp.size > 1:
        axes["cp"] = state.cp
    return {name: value(axis) for name, axis in axes.items()}
