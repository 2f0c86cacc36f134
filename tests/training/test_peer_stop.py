"""One error path for the whole job: bad input met during the run (a batch, a save) stops the
rank that met it with one ``error:`` line and exit code 2, and its peers, waiting for it in a
collective, stop within seconds with one line pointing at it instead of a traceback or a
wait until the backend's timeout."""

from __future__ import annotations

import resource
import subprocess
import sys
import textwrap
import time

import numpy as np
import torch.distributed as dist

from megatron3d.data.dataset_meta import describe, write_meta
from megatron3d.data.prep.indexed_builder import IndexedDatasetBuilder
from megatron3d.resilience.failure_board import FailureBoard
from tests.helpers.launch import ROOT, Job, launch
from tests.helpers.tiny import train_argv
from tests.training.test_real_data import VOCAB, _argv

JOB_LIMIT_S = 60.0


def _finish(job: Job) -> int:
    try:
        return job.wait(timeout_s=120, teardown_s=90)  # the launcher's teardown never helps
    finally:
        job.kill()


def _assert_lines(job: Job, failing: set[int], expected: str) -> None:
    """Each failing rank: exactly one ``error:`` line holding ``expected``; every other rank:
    one line naming a failed rank; no traceback anywhere; every rank exited 2, promptly."""
    for rank, code in enumerate(job.exit_codes):
        text = job.output(rank)
        errors = [ln for ln in text.splitlines() if ln.startswith("error: ")]
        stops = [ln for ln in text.splitlines() if f"rank {rank} stops: rank " in ln]
        assert "Traceback" not in text, text[-3000:]
        assert code == 2, (rank, code, text[-2000:])
        if rank in failing:
            assert len(errors) == 1 and expected in errors[0] and not stops, text[-2000:]
        else:
            assert not errors and len(stops) == 1, text[-2000:]
            assert any(f"stops: rank {r} stopped with an error" in stops[0] for r in failing)
    assert max(job.exit_times) - job.started < JOB_LIMIT_S, job.exit_times


def test_a_data_error_on_one_rank_stops_the_whole_job(tmp_path):
    """DP=2: only rank 1's slice of the first batch holds a token outside the vocabulary (a
    sidecar claiming otherwise gets it past the start-up check, as ids a sample missed)."""
    prefix = str(tmp_path / "foreign_text_document")
    with IndexedDatasetBuilder(prefix, np.int32) as builder:
        for i in range(200):
            builder.add_document([1, 2, 3, VOCAB + 400 if i == 7 else 4, 5, 6, 7, VOCAB])
        builder.finalize()
    write_meta(prefix, describe(prefix, min_token_id=1, max_token_id=VOCAB,
                                vocab_size=VOCAB + 1, tokenizer_type="NullTokenizer"))
    job = launch("pretrain_gpt.py", _argv(prefix, str(tmp_path / "cache"), 3), 2, tmp_path)
    assert _finish(job) == 2
    _assert_lines(job, {1}, f"token id {VOCAB + 400} is outside the vocabulary")


def _small_files() -> None:
    """A full disk, as a write sees it: no file may grow past 64 KiB. Python ignores
    SIGXFSZ, so the write fails (EFBIG). Without ZeRO, DP rank 0 writes every chunk (~400
    KiB) and rank 1 only its RNG states, so rank 0 alone fails."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))


def test_a_save_error_stops_the_whole_job_and_keeps_nothing_half_written(tmp_path):
    save = tmp_path / "ckpt"
    argv = train_argv("gpt2", 3, "--save", str(save), "--save-interval", "2",
                      "--log-interval", "100")
    job = launch("pretrain_gpt.py", argv, 2, tmp_path, preexec=_small_files)
    assert _finish(job) == 2
    _assert_lines(job, {0}, f"cannot write the checkpoint under {save} (")
    assert not (save / "latest").exists()


def test_the_watchdog_stops_a_rank_blocked_in_a_collective_when_a_peer_fails(tmp_path):
    """NCCL never ends the wait of a rank whose peer left: the watchdog thread reads the
    failure from the store while the main thread is blocked in C (a read nobody answers)."""
    store_file = tmp_path / "store"
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(ROOT)!r})
        from pathlib import Path
        import torch.distributed as dist
        from megatron3d.resilience.failure_board import FailureBoard
        from megatron3d.resilience.flight_recorder import FlightRecorder
        from megatron3d.resilience.watchdog import PHASES, Watchdog
        board = FailureBoard(dist.FileStore({str(store_file)!r}, -1), 0)
        Watchdog(FlightRecorder(4), Path({str(tmp_path)!r}), 0, {{"tp": 1, "pp": 1, "dp": 2}},
                 {{"tp": 0, "pp": 0, "dp": 0}}, 0.0, dict.fromkeys(PHASES, 60.0), board).start()
        print("blocked", flush=True)
        os.read(os.pipe()[0], 1)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "blocked\n"
        FailureBoard(dist.FileStore(str(store_file), -1), 1).post()
        posted = time.monotonic()
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 2 and time.monotonic() - posted < 10
    assert err == "rank 0 stops: rank 1 stopped with an error (its 'error:' line says what " \
                  "to fix)\n"


def test_a_rank_that_failed_itself_never_reports_a_peer(tmp_path):
    """Two ranks failing at once both post; each keeps its own error line only."""
    store = dist.FileStore(str(tmp_path / "store"), -1)
    mine, other = FailureBoard(store, 0), FailureBoard(store, 1)
    assert mine.failed_peer() is None
    other.post()
    assert mine.failed_peer() == 1
    mine.post()
    assert mine.failed_peer() is None and not mine.stop_for_peer()
