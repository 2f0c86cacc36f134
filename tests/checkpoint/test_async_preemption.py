"""--async-save under preemption, in real processes: SIGKILL at any moment of the
background saves of a 2-rank job never leaves ``latest`` naming an incomplete checkpoint
(the crash test of test_preemption.py, with the cross-rank publication), and a SIGTERM during
the last background write lets it finish. Ranks run ``tests/helpers/slow_save_run.py``, which
can write one rank's files late so that a kill lands while rank 0 waits for the other's."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from megatron3d.checkpoint.reader import CheckpointReader
from tests.helpers.launch import Job, launch
from tests.helpers.preemption import (
    ITER_LINE,
    LARGE,
    LOADED,
    REPO,
    START_TIMEOUT_S,
    argv,
    iter_dir,
    latest,
)

WORLD = 2
SCRIPT = "tests/helpers/slow_save_run.py"
ASYNC = ["--zero-stage", "1", "--async-save", "--save-interval", "1", "--keep-last-n", "2"]


def _start(workdir: Path, save: Path, *extra: str, slow_rank: int = 1,
           delay_s: float = 0.0) -> Job:
    workdir.mkdir(parents=True, exist_ok=True)
    env = {"SLOW_SAVE_S": str(delay_s), "SLOW_SAVE_RANK": str(slow_rank),
           "PYTHONUNBUFFERED": "1"}
    return launch(SCRIPT, argv(100000, *LARGE, *ASYNC, "--save", str(save), *extra), WORLD,
                  workdir, env=env)


def _iterations(job: Job) -> list[int]:
    """The iterations the logging rank (the last) has printed so far."""
    lines = job.output(WORLD - 1).splitlines()
    return [int(m[1]) for m in map(ITER_LINE.match, lines) if m]


def _wait_for_iteration(job: Job, n: int) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while max(_iterations(job), default=0) < n:
        ended = [p.poll() for p in job.procs if p.poll() is not None]
        assert not ended and time.monotonic() < deadline, (
            f"iteration {n} never printed (exit codes {ended}):\n"
            + job.output(WORLD - 1)[-3000:])
        time.sleep(0.01)


def _one_file_written(save: Path) -> str | None:
    """A staging directory holding rank 0's file but not rank 1's (rank 0 is waiting)."""
    for staging in save.glob("iter_*.tmp"):
        names = {p.name for p in staging.iterdir()} if staging.exists() else set()
        if "rank_00000.pt" in names and "rank_00001.pt" not in names:
            return staging.name
    return None


def _while_rank0_waits(ranks: list[int]):
    """SIGKILL ``ranks`` while rank 0's file is written and rank 1's (written late) is not."""
    def kill(job: Job, save: Path) -> str:
        _wait_for_iteration(job, 2)
        deadline, seen = time.monotonic() + START_TIMEOUT_S, None
        while seen is None and time.monotonic() < deadline:
            seen = _one_file_written(save)
        for rank in ranks:
            job.procs[rank].send_signal(signal.SIGKILL)
        assert seen, "rank 0 was never seen waiting for rank 1's file"
        return f"ranks {ranks} killed while {seen} held rank 0's file only"
    return kill


def _after(n: int, delay_s: float):
    def kill(job: Job, save: Path) -> str:
        _wait_for_iteration(job, n)
        time.sleep(delay_s)
        job.kill()
        return f"killed {delay_s * 1000:.0f} ms after iteration {n}"
    return kill


def _assert_complete(save: Path, iteration: int, when: str) -> None:
    """``iter_X`` has a valid meta.json of that iteration and every rank's file, whole."""
    directory = iter_dir(save, iteration)
    reader = CheckpointReader(directory)  # meta.json and each rank file, checked
    assert reader.meta["iteration"] == iteration, when
    for rank in range(WORLD):  # read every byte (a truncated file fails here)
        payload = torch.load(directory / f"rank_{rank:05d}.pt", weights_only=True)
        assert payload["chunks"] and payload["iteration"] == iteration, (when, rank)


def test_sigkill_during_async_saves_leaves_a_complete_latest(tmp_path):
    rng = random.Random(20240917)
    kills = [(_while_rank0_waits([0, 1]), 1.0), (_while_rank0_waits([1]), 1.0),
             (_after(2, rng.uniform(0.0, 0.3)), 0.0), (_after(3, rng.uniform(0.0, 0.3)), 0.0)]
    for n, (kill, delay_s) in enumerate(kills):
        save = tmp_path / f"try{n}" / "ckpt"
        job = _start(tmp_path / f"try{n}" / "run", save, delay_s=delay_s)
        try:
            when = kill(job, save)
            job.wait(START_TIMEOUT_S, teardown_s=START_TIMEOUT_S)
        finally:
            job.kill()
        # A survivor stops by itself: its save in flight does not keep it alive.
        assert job.exit_codes[1] == -signal.SIGKILL and None not in job.exit_codes, (
            when, job.exit_codes)
        last = latest(save)
        if last is None:
            assert not list(save.glob("iter_*[0-9]")), (when, sorted(os.listdir(save)))
            continue
        _assert_complete(save, last, when)
        resumed = _start(tmp_path / f"try{n}" / "resume", save, "--load", str(save),
                         "--exit-interval", str(last + 1))
        assert resumed.wait(START_TIMEOUT_S) == 0, (when, resumed.output(WORLD - 1)[-3000:])
        m = LOADED.search(resumed.output(WORLD - 1))
        assert m and int(m[2]) == last, when
        assert _iterations(resumed) == [last + 1], when
        assert latest(save) == last + 1, when
        _assert_complete(save, last + 1, when)


def test_a_sigterm_during_the_last_background_write_lets_it_finish(tmp_path):
    """The launcher's forwarded SIGTERM arrives while the final save is written in the
    background: the run waits for it under its signal handlers and exits 0."""
    save = tmp_path / "ckpt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SLOW_SAVE_S": "0.5", "SIGTERM_AT_SAVE": "2"}
    done = subprocess.run([sys.executable, SCRIPT, *argv(100, "--async-save", "--save",
                                                         str(save), "--exit-interval", "2")],
                          cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=START_TIMEOUT_S)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "saved checkpoint at iteration 2" in done.stdout, done.stdout[-2000:]
    assert latest(save) == 2
    assert (iter_dir(save, 2) / "rank_00000.pt").is_file()
