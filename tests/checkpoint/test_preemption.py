"""Preemption in real processes: signals, SIGKILL mid-run and mid-save, exit conditions.
Each test but the last runs ``pretrain_gpt.py`` as a child (signals, exit codes and files as
a SLURM job sees them) and parses its per-iteration log lines (``--log-interval 1``)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import pretrain_gpt
from tests.helpers.preemption import (
    DROPOUT,
    ITER_LINE,
    LARGE,
    LOADED,
    MEDIUM,
    REPO,
    START_TIMEOUT_S,
    argv,
    iter_dir,
    latest,
)

EXIT_TIMEOUT_S = 10.0  # a signalled run finishes two steps and saves a tiny checkpoint


class Run:
    """One ``pretrain_gpt.py`` child process and the lines it has printed so far."""

    def __init__(self, argv: list[str]) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, "pretrain_gpt.py", *argv], cwd=REPO,
                                     env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.eof = False
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self.eof = True
            self._cond.notify_all()

    @property
    def output(self) -> str:
        with self._cond:
            return "\n".join(self.lines)

    @property
    def tail(self) -> str:
        """The last lines, for failure messages (the argument table is long)."""
        with self._cond:
            return "\n".join(self.lines[-25:])

    def iterations(self) -> dict[int, tuple[str, ...]]:
        """Iteration -> (consumed samples, lr, loss, grad norm), as printed."""
        with self._cond:
            found = [ITER_LINE.match(line) for line in self.lines]
        return {int(m[1]): m.groups()[1:] for m in found if m}

    def wait_for_iteration(self, n: int, timeout: float = START_TIMEOUT_S) -> int:
        """Block until iteration ``n`` (or a later one) was printed; the newest printed."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                done = [int(m[1]) for m in map(ITER_LINE.match, self.lines) if m]
                if done and max(done) >= n:
                    return max(done)
                left = deadline - time.monotonic()
                if self.eof or left <= 0:
                    raise AssertionError(f"iteration {n} never printed (exit code "
                                         f"{self.proc.poll()}):\n" + "\n".join(self.lines[-25:]))
                self._cond.wait(left)

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def finish(self, timeout: float = START_TIMEOUT_S) -> int:
        """Wait for the exit; the exit code (all output is read by then)."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"run did not exit within {timeout:.0f}s:\n"
                                 + self.tail) from None
        self._reader.join(timeout=10.0)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._reader.join(timeout=10.0)


@contextlib.contextmanager
def launch(argv: list[str]) -> Iterator[Run]:
    """A run that is killed on the way out if the test did not wait for it."""
    run = Run(argv)
    try:
        yield run
    finally:
        run.kill()
        if run.proc.stdout is not None:
            run.proc.stdout.close()


def run_to_end(argv: list[str], timeout: float = START_TIMEOUT_S) -> Run:
    with launch(argv) as run:
        code = run.finish(timeout)
        assert code == 0, f"exit code {code}:\n{run.tail}"
        return run


def assert_complete(root: Path, iteration: int) -> dict:
    """``iter_X`` holds a readable meta.json of that iteration and a loadable rank file."""
    directory = iter_dir(root, iteration)
    assert (directory / "meta.json").is_file(), sorted(os.listdir(root))
    meta = json.loads((directory / "meta.json").read_text())
    assert meta["iteration"] == iteration, meta["iteration"]
    payload = torch.load(directory / "rank_00000.pt", map_location="cpu", weights_only=False)
    assert payload["chunks"], f"{directory} has no chunks"
    return meta


def stale_tmp_dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.glob("iter_*.tmp"))


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().cpu().numpy().tobytes()


def assert_same_checkpoint(a: Path, b: Path) -> None:
    """Bitwise equal chunks (weights, Adam moments), torch RNG streams and run state. (The
    Python and numpy global RNGs are saved too, but nothing seeds or draws from them, so two
    processes hold unrelated states.)"""
    pa = torch.load(a / "rank_00000.pt", map_location="cpu", weights_only=False)
    pb = torch.load(b / "rank_00000.pt", map_location="cpu", weights_only=False)
    ca = {(c["name"], c["kind"], c["start"]): c["data"] for c in pa["chunks"]}
    cb = {(c["name"], c["kind"], c["start"]): c["data"] for c in pb["chunks"]}
    assert ca and ca.keys() == cb.keys()
    differ = [k for k in ca if ca[k].dtype != cb[k].dtype
              or tensor_bytes(ca[k]) != tensor_bytes(cb[k])]
    assert not differ, f"{len(differ)} of {len(ca)} chunks differ, e.g. {differ[:3]}"
    ra, rb = pa["rng"]["torch"], pb["rng"]["torch"]
    assert ra.keys() == rb.keys()
    assert all(tensor_bytes(ra[k]) == tensor_bytes(rb[k]) for k in ra), "torch RNG differs"
    ma, mb = (json.loads((d / "meta.json").read_text()) for d in (a, b))
    for key in ("iteration", "consumed_samples", "consumed_tokens", "adam_step", "loss_scaler"):
        assert ma[key] == mb[key], (key, ma[key], mb[key])


# 1. SIGTERM / SIGUSR1: stop a step after the step in flight (agreed a step late), save, exit 0.

@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1], ids=lambda s: s.name)
def test_signal_saves_and_exits_cleanly(tmp_path, signum):
    save = tmp_path / "ckpt"
    with launch(argv(100000, *MEDIUM, "--save", str(save))) as run:
        seen = run.wait_for_iteration(3)
        sent = time.monotonic()
        run.signal(signum)
        code = run.finish(EXIT_TIMEOUT_S)
        took = time.monotonic() - sent
    assert code == 0, f"exit code {code}:\n{run.tail}"
    assert took < EXIT_TIMEOUT_S, took
    last = max(run.iterations())
    # The step in flight finishes, the ranks agree on the signal after the next one, then
    # the run stops; the rest of the slack is for the reader thread lagging the child on a
    # loaded machine (a run that ignored the flag would go on).
    assert seen <= last <= seen + 4, (seen, last)
    assert f"stopping at iteration {last}" in run.output, run.tail
    assert latest(save) == last >= 3
    assert_complete(save, last)
    assert stale_tmp_dirs(save) == []


# 2. SIGKILL mid-training, then resume: bitwise the continuous run.

def test_sigkill_then_resume_matches_continuous_run(tmp_path):
    model = [*LARGE, *DROPOUT]
    cont, killed, resumed = tmp_path / "cont", tmp_path / "killed", tmp_path / "resumed"
    continuous = run_to_end(argv(12, *model, "--save", str(cont))).iterations()
    assert sorted(continuous) == list(range(1, 13))

    with launch(argv(12, *model, "--save", str(killed), "--save-interval", "4")) as run:
        run.wait_for_iteration(6)
        run.signal(signal.SIGKILL)
        assert run.finish() == -signal.SIGKILL
    first = run.iterations()
    assert latest(killed) == 4, f"killed after iteration {max(first)}: latest {latest(killed)}"
    assert_complete(killed, 4)
    assert all(first[i] == continuous[i] for i in range(1, 7)), "runs differ before the kill"

    again = run_to_end(argv(12, *model, "--load", str(killed), "--save", str(resumed),
                            "--save-interval", "4"))
    m = LOADED.search(again.output)
    assert m and int(m[2]) == 4 and Path(m[1]) == iter_dir(killed, 4), again.tail
    after = again.iterations()
    assert sorted(after) == list(range(5, 13))
    for i in range(5, 13):  # consumed samples, lr, loss, grad norm: as printed
        assert after[i] == continuous[i], (i, after[i], continuous[i])
    assert latest(resumed) == 12
    assert_same_checkpoint(iter_dir(resumed, 12), iter_dir(cont, 12))


# 3. A killed save never corrupts ``latest``.

def test_stale_tmp_from_killed_save_is_ignored_then_cleaned(tmp_path):
    save = tmp_path / "ckpt"
    run_to_end(argv(8, "--save", str(save), "--exit-interval", "4"))
    assert latest(save) == 4
    # What SIGKILL during the save of iteration 8 leaves: a half-written rank file, no meta.
    good = (iter_dir(save, 4) / "rank_00000.pt").read_bytes()
    partial = save / "iter_0000008.tmp"
    partial.mkdir()
    (partial / "rank_00000.pt").write_bytes(good[: len(good) // 2])

    run = run_to_end(argv(8, "--load", str(save), "--save", str(save), "--save-interval", "4"))
    m = LOADED.search(run.output)
    assert m and int(m[2]) == 4, run.tail
    assert sorted(run.iterations()) == [5, 6, 7, 8]
    assert latest(save) == 8
    assert_complete(save, 8)
    assert stale_tmp_dirs(save) == []


def test_killed_first_save_lets_a_requeued_run_start_from_scratch(tmp_path):
    """SIGKILL during a run's first save leaves only ``iter_X.tmp``: no checkpoint exists, so
    the same command (``--load DIR --save DIR``) must start from scratch, as it would on an
    empty directory."""
    save = tmp_path / "ckpt"
    partial = save / "iter_0000001.tmp"
    partial.mkdir(parents=True)
    (partial / "rank_00000.pt").write_bytes(b"PK\x03\x04 truncated")
    run = run_to_end(argv(2, "--load", str(save), "--save", str(save)))
    assert LOADED.search(run.output) is None, run.tail
    assert sorted(run.iterations()) == [1, 2]
    assert latest(save) == 2
    assert_complete(save, 2)


def test_save_killed_between_rename_and_latest_is_redone(tmp_path):
    """SIGKILL after ``iter_8.tmp`` became ``iter_8`` but before ``latest`` was rewritten:
    the resumed run starts at 4, reaches 8 again and must publish its own iteration 8."""
    save = tmp_path / "ckpt"
    run_to_end(argv(8, "--save", str(save), "--save-interval", "4"))
    assert latest(save) == 8
    (save / "latest").write_text("4\n")  # as the killed save left it
    before = (iter_dir(save, 8) / "rank_00000.pt").stat().st_mtime_ns

    run = run_to_end(argv(8, "--load", str(save), "--save", str(save), "--save-interval", "4"))
    m = LOADED.search(run.output)
    assert m and int(m[2]) == 4, run.tail
    assert sorted(run.iterations()) == [5, 6, 7, 8]
    assert "saved checkpoint at iteration 8" in run.output, run.tail
    assert latest(save) == 8, "the resumed run's final save did not move latest"
    assert_complete(save, 8)
    assert (iter_dir(save, 8) / "rank_00000.pt").stat().st_mtime_ns != before, \
        "iteration 8 still holds the killed run's files, not this run's state"


def _kill_during_save(run: Run, save: Path) -> str:
    """After iteration 2 (checkpoint 1 complete), kill as soon as a save is in flight."""
    run.wait_for_iteration(2)
    deadline = time.monotonic() + START_TIMEOUT_S
    in_flight: list[str] = []
    while not in_flight and time.monotonic() < deadline:
        in_flight = stale_tmp_dirs(save)
        time.sleep(0.0005)
    run.signal(signal.SIGKILL)
    assert in_flight, "no save was seen in flight"
    return f"during the save into {in_flight[0]}"


def _kill_after(n: int, delay: float):
    def kill(run: Run, save: Path) -> str:
        run.wait_for_iteration(n)
        time.sleep(delay)
        run.signal(signal.SIGKILL)
        return f"{delay * 1000:.0f} ms after iteration {n}"
    return kill


def test_sigkill_at_random_moments_leaves_a_loadable_latest(tmp_path):
    rng = random.Random(20240607)
    kills = [_kill_during_save, _kill_after(2, rng.uniform(0.0, 0.25)),
             _kill_after(3, rng.uniform(0.0, 0.25))]
    model = [*LARGE, "--save-interval", "1"]
    for n, kill in enumerate(kills):
        save = tmp_path / f"try{n}"
        with launch(argv(100000, *model, "--save", str(save))) as run:
            when = kill(run, save)
            assert run.finish() == -signal.SIGKILL
        last = latest(save)
        if last is None:
            assert not list(save.glob("iter_*[0-9]")), (when, sorted(os.listdir(save)))
            continue
        assert_complete(save, last)
        resumed = run_to_end(argv(100000, *model, "--load", str(save), "--save", str(save),
                                  "--exit-interval", str(last + 1)))
        m = LOADED.search(resumed.output)
        assert m and int(m[2]) == last, (when, resumed.tail)
        assert sorted(resumed.iterations()) == [last + 1], when
        assert latest(save) == last + 1, when
        assert_complete(save, last + 1)


_SIGTERM_DURING_SAVE = """
import os, signal, sys
sys.path.insert(0, os.getcwd())
from megatron3d.checkpoint import saving
import pretrain_gpt
real = saving.save
def save(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)  # the launcher's forwarded SIGTERM, mid-save
    return real(*args, **kwargs)
saving.save = save
sys.exit(pretrain_gpt.main(sys.argv[1:]))
"""


def test_a_second_sigterm_does_not_kill_the_final_save(tmp_path):
    """scancel signals the workers and torchrun, and torchrun forwards its SIGTERM a moment
    later: one arriving during the final save must leave it to finish."""
    save = tmp_path / "ckpt"
    done = subprocess.run([sys.executable, "-c", _SIGTERM_DURING_SAVE,
                           *argv(100, "--save", str(save), "--exit-interval", "2")],
                          cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=START_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-2000:]
    assert latest(save) == 2
    assert_complete(save, 2)


# 4. --exit-interval and --exit-duration-in-mins.

def test_exit_interval_saves_and_exits(tmp_path):
    save = tmp_path / "ckpt"
    run = run_to_end(argv(100, "--save", str(save), "--exit-interval", "3"))
    assert sorted(run.iterations()) == [1, 2, 3]
    assert "stopping at iteration 3" in run.output, run.tail
    assert latest(save) == 3
    assert_complete(save, 3)


def test_exit_duration_saves_and_exits_after_first_step(tmp_path):
    """0.0001 min = 6 ms: spent on start-up (from pretrain_gpt.py's first line to the loop:
    40 ms here), so it stops after step 1 (``exit_watch.py``: the flags posted before step 1
    are read after it); a budget spent during step i stops after step i + 1."""
    save = tmp_path / "ckpt"
    run = run_to_end(argv(100, *LARGE, "--save", str(save), "--exit-duration-in-mins",
                          "0.0001"))
    assert sorted(run.iterations()) == [1], run.tail
    assert "stopping at iteration 1 (--exit-duration-in-mins" in run.output, run.tail
    assert latest(save) == 1
    assert_complete(save, 1)


# 5. --load on a missing or empty directory starts from scratch.

def test_load_missing_or_empty_directory_starts_from_scratch(tmp_path, capsys):
    """No signal or exit is at stake here: ``pretrain_gpt.main`` runs in this process (two
    child processes cost seconds of imports)."""
    empty = tmp_path / "empty"
    empty.mkdir()
    for directory in (tmp_path / "missing", empty):
        assert pretrain_gpt.main(argv(2, "--load", str(directory))) == 0
        captured = capsys.readouterr()
        output = captured.out + captured.err
        assert f"no checkpoint in {directory}" in output, output[-3000:]
        iterations = [int(m[1]) for m in map(ITER_LINE.match, output.splitlines()) if m]
        assert iterations == [1, 2], output[-3000:]
        assert LOADED.search(output) is None, output[-3000:]
