"""--async-save on 2 gloo ranks in-process: training goes on while a save is written, a
resume from an asynchronous save is bitwise the continuous run, and a save that fails or is
refused leaves the published checkpoints as a synchronous one does. Rank files are written
late (``io.write_rank`` patched to sleep first) so that training is surely ahead of the
writer."""

from __future__ import annotations

import contextlib
import errno
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron3d.checkpoint import io
from megatron3d.checkpoint.progress import Progress
from megatron3d.errors import CheckpointError, TrainingError
from tests.helpers.dist import run_distributed
from tests.helpers.host_sync import GuardedSteps
from tests.helpers.preemption import latest
from tests.helpers.runs import build, merge_ranks, train
from tests.helpers.tiny import train_argv

SLOW_S = 0.4  # how late each rank file is written: many steps of the tiny model
ASYNC = ("--zero-stage", "1", "--async-save")  # DP=2: each rank writes half of the state


@contextlib.contextmanager
def slow_writes(delay_s: float, fail_at: int | None = None,
                fail_rank: int = 1) -> Iterator[list[tuple[int, float, float]]]:
    """``io.write_rank`` sleeps ``delay_s`` first and records (iteration, start, end); at
    iteration ``fail_at`` rank ``fail_rank`` meets a full disk instead."""
    real, writes = io.write_rank, []

    def write(directory: Path, rank: int, payload: dict[str, Any]) -> None:
        start = time.monotonic()
        time.sleep(delay_s)
        if payload["iteration"] == fail_at and rank == fail_rank:
            raise OSError(errno.ENOSPC, "No space left on device", str(directory))
        real(directory, rank, payload)
        writes.append((payload["iteration"], start, time.monotonic()))

    io.write_rank = write
    try:
        yield writes
    finally:
        io.write_rank = real


def _overlap(directory: str) -> dict:
    finished: dict[int, float] = {}
    trainer, _ = build(train_argv("gpt2", 6, *ASYNC, "--save", directory, "--save-interval",
                                  "2"), on_step=lambda it, _: finished.__setitem__(
                                      it, time.monotonic()))
    with slow_writes(SLOW_S) as writes:
        trainer.run()
    return {"finished": finished, "writes": writes, "returned": time.monotonic(),
            "latest": latest(Path(directory))}


def test_training_steps_go_on_while_a_save_is_written(tmp_path):
    for rank, run in enumerate(run_distributed(_overlap, 2, str(tmp_path / "ckpt"))):
        # The end of the run meets the interval at 6: that save is not written twice.
        assert [it for it, _, _ in run["writes"]] == [2, 4, 6], rank
        for it, start, end in run["writes"][:-1]:  # the save of ``it`` began after step it
            assert run["finished"][it + 1] < end, (
                f"rank {rank}: step {it + 1} did not run while iteration {it}'s file was "
                f"written ({start:.3f} .. {end:.3f}, step done {run['finished'][it + 1]:.3f})")
        assert run["writes"][-1][2] < run["returned"], "the run did not wait for its last save"
        assert run["latest"] == 6, rank


RAMP = ("--global-batch-size", "16", "--rampup-batch-size", "4", "4", "48")


def _argv(*extra: str) -> list[str]:
    """12 steps with dropout, the batch ramping over the save at step 5."""
    return train_argv("bloom", 12, *RAMP, "--hidden-dropout", "0.1", "--attention-dropout",
                      "0.1", *extra)


def _resume_from_async_save(directory: str, layout: tuple[str, ...]) -> dict:
    continuous = train(_argv(*layout))
    with slow_writes(SLOW_S):  # steps 6.. run while iteration 5 is written, then 10, 12
        saving = train(_argv(*layout, "--async-save", "--save", directory, "--save-interval",
                             "5"))
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:  # resume from the save at 5, not the last one
        (Path(directory) / "latest").write_text("5\n")
    torch.distributed.barrier()
    resumed = train(_argv(*layout, "--load", directory))
    return {"continuous": continuous, "saving": saving, "resumed": resumed}


@pytest.mark.cuda
@pytest.mark.parametrize("layout", [("--zero-stage", "1"),
                                    ("--pipeline-model-parallel-size", "2")],
                         ids=["dp2-zero1", "pp2"])
def test_resume_from_an_async_save_is_bitwise_exact(tmp_path, layout):
    """On a GPU the save's state goes through pinned host memory (``device.host_buffer``)."""
    per_rank = run_distributed(_resume_from_async_save, 2, str(tmp_path / "ckpt"), layout,
                               timeout_s=300)
    runs = {k: merge_ranks([r[k] for r in per_rank]) for k in per_rank[0]}
    assert runs["saving"].losses == runs["continuous"].losses  # saving changes nothing
    assert len(runs["resumed"].losses) == 7
    assert runs["resumed"].losses == runs["continuous"].losses[5:]  # bitwise
    assert runs["resumed"].grad_norms == runs["continuous"].grad_norms[5:]
    for name, value in runs["continuous"].params.items():
        assert torch.equal(runs["resumed"].params[name], value), name


def _failed_write(directory: str) -> dict:
    trainer, _ = build(train_argv("gpt2", 6, *ASYNC, "--save", directory, "--save-interval",
                                  "2"))
    with slow_writes(0.0, fail_at=4):
        try:
            trainer.run()
        except CheckpointError as err:
            return {"error": str(err), "at": trainer.progress.iteration,
                    "latest": latest(Path(directory))}
    return {"error": None}


def test_a_failed_background_write_stops_every_rank_and_keeps_latest(tmp_path):
    directory = tmp_path / "ckpt"
    results = run_distributed(_failed_write, 2, str(directory), timeout_s=60)
    for rank, result in enumerate(results):  # raised at the next save, on every rank
        assert result["at"] == 6 and result["latest"] == 2, (rank, result)
    assert results[1]["error"].startswith(f"cannot write the checkpoint under {directory} "
                                          "(No space left on device"), results[1]["error"]
    assert results[0]["error"] == (
        "another rank could not write its part of the checkpoint of iteration 4 (its output "
        f"says why): nothing was published and the checkpoints already saved in {directory} "
        "are kept")


def _refused_while_saving(directory: str) -> dict:
    """Train 3 steps; save 4 in the background, then one rank's weights go NaN and a save
    at 5 is asked: it finishes 4 first, then refuses."""
    trainer, state = build(train_argv("gpt2", 3, *ASYNC, "--save", directory))
    trainer.run()
    with slow_writes(SLOW_S):
        trainer.save(Progress(4, 32, 512))
        if state.world_rank == 1:
            weights = trainer.model.optimizer.inner.param_groups[0]["params"][0]
            weights.data.view(-1)[0] = float("nan")
        try:
            trainer.save(Progress(5, 40, 640))
        except TrainingError as err:
            return {"error": str(err), "latest": latest(Path(directory)),
                    "files": sorted(p.name for p in Path(directory).iterdir())}
    return {"error": None}


def test_a_non_finite_save_is_refused_after_the_one_in_flight(tmp_path):
    directory = tmp_path / "ckpt"
    for rank, result in enumerate(run_distributed(_refused_while_saving, 2, str(directory))):
        assert result["error"] is not None and result["error"].startswith(
            "the weights at iteration 5 are not finite"), rank
        assert result["latest"] == 4, rank
        assert result["files"] == ["iter_0000003", "iter_0000004", "latest"], rank


def _steps_without_sync(directory: str) -> list[int]:
    """Steps 2..7 under ``no_host_sync`` while the saves of 3 and 6 are written in the
    background (each save may sync, as its heartbeat allowance says)."""
    guard = GuardedSteps(last=7)
    trainer, _ = build(train_argv("gpt2", 7, *ASYNC, "--save", directory, "--save-interval",
                                  "3", "--log-interval", "100"),
                       heartbeat=guard, on_step=guard.on_step)
    with slow_writes(SLOW_S) as writes:
        trainer.run()
    assert [it for it, _, _ in writes] == [3, 6, 7]
    return guard.guarded


def test_steps_never_sync_with_the_host_while_a_save_is_written(tmp_path):
    assert run_distributed(_steps_without_sync, 2, str(tmp_path / "ckpt")) == [
        list(range(2, 8))] * 2
