"""In-job restart, the worker's side: a SIGTERM ends a rank blocked on a peer that is gone
(within ``term_grace.GRACE_S``), never one that still works or saves; a restarted worker says
which restart it is and where it resumes."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from megatron3d.resilience.restart import Restart
from megatron3d.resilience.term_grace import GRACE_S, TERM_EXIT_CODE, TermGrace
from tests.helpers.launch import ROOT


def test_grace_counts_only_time_blocked_with_nothing_finishing():
    grace = TermGrace(2.0)
    assert not grace.expired(100.0, (5, 1), saving=False)  # no signal: never
    grace.signalled(100.0)
    assert not grace.expired(100.1, (5, 1), saving=False)
    assert not grace.expired(101.5, (6, 1), saving=False)  # issued another: it moves
    assert not grace.expired(103.0, (6, 1), saving=False)  # 1.5 s still
    assert grace.expired(103.6, (6, 1), saving=False)  # 2.1 s still, waiting on one
    computing = TermGrace(2.0)  # nothing in flight: computing, not blocked
    computing.signalled(0.0)
    assert not any(computing.expired(t, (9, 0), saving=False) for t in (0.1, 3.0, 9.0))
    assert computing.expired(11.5, (9, 1), saving=False) is False  # waiting starts now
    assert computing.expired(13.6, (9, 1), saving=False)
    saving = TermGrace(2.0)  # a save's writes issue no collectives for long stretches
    saving.signalled(0.0)
    assert not any(saving.expired(t, (3, 1), saving=True) for t in (0.1, 5.0, 30.0))


def test_sigterm_ends_a_process_blocked_in_a_collective(tmp_path):
    """The main thread blocks in C (a read nobody answers) with an operation in flight, as a
    rank whose peer died does under NCCL; its Python SIGTERM handler (the exit watch's) only
    sets a flag. The watchdog thread ends it GRACE_S after the signal, with one line."""
    script = textwrap.dedent(f"""
        import os, signal, sys, torch
        sys.path.insert(0, {str(ROOT)!r})
        import megatron3d.resilience.watchdog as w
        from pathlib import Path
        from megatron3d.mpu.state import AxisGroup
        from megatron3d.resilience.flight_recorder import FlightRecorder
        dog = w.Watchdog(FlightRecorder(4), Path({str(tmp_path)!r}), 3, {{"tp": 1, "pp": 1,
                         "dp": 2}}, {{"tp": 0, "pp": 0, "dp": 1}}, 0.0,
                         dict.fromkeys(w.PHASES, 600.0)).start()
        dog.beat(7)
        dog.recorder("all_reduce", torch.zeros(2), AxisGroup.single())  # never posted
        signal.signal(signal.SIGTERM, lambda signum, frame: None)
        os.kill(os.getpid(), signal.SIGTERM)
        read_end, _ = os.pipe()
        os.read(read_end, 1)
    """)
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == TERM_EXIT_CODE, done.stderr
    assert time.monotonic() - started < GRACE_S + 15  # start-up (import torch) included
    assert ("rank 3 (tp 0, pp 0, dp 1): SIGTERM while waiting in a collective with nothing "
            f"finishing for {GRACE_S:g} s (a peer is gone)") in done.stderr


@pytest.mark.parametrize("env,line", [
    ({}, None),
    ({"TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "2"}, None),
    ({"TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_MAX_RESTARTS": "2"},
     "restart 1 of 2 (torchrun restarted the workers after a failure): resuming from "
     "iteration 5 (the state loaded above)"),
])
def test_a_restarted_worker_says_which_restart_it_is(monkeypatch, env, line):
    for name in ("TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    restart = Restart.from_env()
    assert (restart.line(5) if restart else None) == line


def test_a_restart_with_nothing_to_resume_from_says_so(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    assert Restart.from_env().line(0) == (
        "restart 2 of 3 (torchrun restarted the workers after a failure): resuming from "
        "iteration 0: nothing was saved to resume from (set --load to the --save directory, "
        "or --non-persistent-save-interval)")
