"""End to end: injected hangs at PP=2 x DP=2 end in dumps, a non-zero exit and a report that
names the injected rank; SIGUSR2 dumps without stopping; mismatched flags fail everywhere.

Each test launches 4 real ranks of ``pretrain_gpt.main`` (with a fault installed from
outside by ``tests/helpers/faulty_run.py``) through a torchrun-like launcher.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import time
from pathlib import Path

import pytest

from megatron3d.resilience.hang_dump import read_dump
from megatron3d.resilience.watchdog import HANG_EXIT_CODE
from megatron3d.tools import hang_report
from tests.helpers.launch import Job, launch

HANG_TIMEOUT = 4.0
WORLD = 4
FAULT_STEP = 3
COORDS = {0: "(tp 0, pp 0, dp 0)", 1: "(tp 0, pp 0, dp 1)", 2: "(tp 0, pp 1, dp 0)",
          3: "(tp 0, pp 1, dp 1)"}


def _args(dump_dir: Path, iters: int = 40) -> list[str]:
    return ("--pipeline-model-parallel-size 2 --num-layers 2 --hidden-size 32 "
            "--num-attention-heads 4 --seq-length 16 --micro-batch-size 1 "
            f"--global-batch-size 8 --train-iters {iters} --lr 1e-3 --mock-data --vocab-size 128 "
            f"--log-interval 1 --eval-iters 0 --hang-timeout {HANG_TIMEOUT} "
            f"--hang-startup-timeout 300 --hang-dump-dir {dump_dir}").split()


def _run(tmp_path: Path, fault: str, rank: int, iters: int = 40, extra: dict | None = None
         ) -> Job:
    env = {"FAULT": fault, "FAULT_RANK": str(rank), "FAULT_STEP": str(FAULT_STEP),
           "FAULT_DIR": str(tmp_path), "FAULT_PID_FILE": str(tmp_path / "pid"), **(extra or {})}
    return launch("tests/helpers/faulty_run.py", _args(tmp_path / "hang", iters), WORLD,
                  tmp_path, env)


def _report(dump_dir: Path) -> str:
    """tools/hang_report.py's output, from its main in this process (its command line is
    tests/test_tools.py's; a process of its own would only import torch again)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert hang_report.main([str(dump_dir)]) == 0
    return out.getvalue()


def _culprits(report: str) -> list[str]:
    return [line.strip() for line in report.split("likely culprits:")[1].splitlines()[1:]]


def _check_exits(job: Job, tmp_path: Path, live: list[int], hung_at: float) -> None:
    """Every live rank exited with the hang code within hang-timeout + 30 s of the hang,
    leaving a dump."""
    for r in live:
        assert job.exit_codes[r] == HANG_EXIT_CODE, (r, job.exit_codes, job.output(r)[-2000:])
        assert job.exit_times[r] - hung_at <= HANG_TIMEOUT + 30, (r, job.exit_times[r] - hung_at)
        assert read_dump(tmp_path / "hang" / f"rank-{r:05d}.txt")["rank"] == r


def _hang_start(tmp_path: Path) -> float:
    """When the last step before the hang finished (the newest progress marker), in the
    launcher's monotonic clock."""
    newest = max(p.stat().st_mtime for p in tmp_path.glob("steps-*"))
    return time.monotonic() - (time.time() - newest)


def _hung(tmp_path: Path, fault: str, rank: int) -> tuple[str, list[str]]:
    """Inject ``fault`` on ``rank``; every rank must dump and exit; -> (report, culprits)."""
    job = _run(tmp_path, fault, rank=rank)
    assert job.wait(240) == HANG_EXIT_CODE
    _check_exits(job, tmp_path, [0, 1, 2, 3], _hang_start(tmp_path))
    report = _report(tmp_path / "hang")
    return report, _culprits(report)


def test_skipped_send_is_named(tmp_path):
    report, culprits = _hung(tmp_path, "skip-send", 0)
    assert culprits[0].startswith(f"rank 0 {COORDS[0]}: skipped or reordered a send"), report
    assert len(culprits) == 1, report
    assert "mismatched: rank 0 sends F1" in report and "rank 2 expects F0" in report, report


def test_sleeping_rank_is_named(tmp_path):
    report, culprits = _hung(tmp_path, "sleep", 3)
    assert len(culprits) == 1 and culprits[0].startswith(f"rank 3 {COORDS[3]}: behind its "
                                                         "peers"), report
    assert culprits[0].endswith("while waiting for nobody: it stopped issuing operations "
                                "(see its stack)"), report
    assert f"rank 3 {COORDS[3]}: iteration {FAULT_STEP - 1} done" in report
    assert "main thread at faulty_run.py" in report.split(f"rank 3 {COORDS[3]}")[1], report


@pytest.mark.parametrize("frozen", [1, 3])
def test_frozen_rank_is_the_only_culprit(tmp_path, frozen):
    """SIGSTOP freezes one rank mid-step; its pipeline peer then waits on a receive from it
    and the other ranks wait for those two in their DP all-reduces: only the frozen rank is
    named (a rank blocked on a frozen peer waits for somebody)."""
    job = _run(tmp_path, "stop", rank=frozen)
    pid_file = tmp_path / "pid"
    deadline = time.monotonic() + 180
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline and all(p.poll() is None for p in job.procs)
        time.sleep(0.05)
    os.kill(int(pid_file.read_text()), signal.SIGSTOP)
    stopped_at = time.monotonic()
    assert job.wait(240, teardown_s=8, frozen=(frozen,)) == HANG_EXIT_CODE
    _check_exits(job, tmp_path, [r for r in range(WORLD) if r != frozen], stopped_at)
    assert not (tmp_path / "hang" / f"rank-{frozen:05d}.txt").exists()
    report = _report(tmp_path / "hang")
    assert f"rank {frozen} {COORDS[frozen]}: NO DUMP" in report
    assert _culprits(report) == [f"rank {frozen} {COORDS[frozen]}: wrote no dump: frozen (e.g. "
                                 "SIGSTOP), dead, or never started"], report


def test_sigusr2_dumps_and_training_continues(tmp_path):
    # The signal lands a few steps in (the wait below): 60 steps leave over 50 for the dump,
    # which takes one watchdog poll (0.1 s); a step at least as long as the test's 0.05 s poll.
    iters = 60
    job = _run(tmp_path, "", rank=-1, iters=iters)
    marker = tmp_path / "steps-2"
    deadline = time.monotonic() + 180
    while not marker.exists() or int(marker.read_text() or 0) < 3:
        assert time.monotonic() < deadline and all(p.poll() is None for p in job.procs)
        time.sleep(0.05)
    job.procs[2].send_signal(signal.SIGUSR2)
    assert job.wait(300) == 0, [job.output(r)[-2000:] for r in range(WORLD)]
    dump = read_dump(tmp_path / "hang" / "rank-00002.txt")
    assert dump["reason"].startswith("SIGUSR2") and dump["iteration"] < iters
    assert dump["ops"], "the dump holds the recent collectives"
    assert f"iteration {iters:8d}/{iters:8d}" in job.output(3)  # the log line's widths
    assert not (tmp_path / "hang" / "rank-00000.txt").exists()


def test_different_flags_fail_everywhere(tmp_path):
    job = _run(tmp_path, "flag", rank=3, extra={"FAULT_FLAG": "--hidden-size",
                                                   "FAULT_VALUE": "64"})
    assert job.wait(180) == 2
    for r in range(WORLD):
        errors = [line for line in job.output(r).splitlines() if line.startswith("error:")]
        assert job.exit_codes[r] == 2 and len(errors) == 1, job.output(r)[-2000:]
        assert "--hidden-size" in errors[0], errors
