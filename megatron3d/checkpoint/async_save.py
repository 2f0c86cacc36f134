"""Asynchronous save (``--async-save``): the state is copied to host memory at the save's
step, and a thread writes it while training goes on.

On the main thread, at the save's step: the fp32 weights and Adam moments this rank writes
are copied into the saver's host buffer (``snapshot.py``: allocated once, pinned on GPUs)
whose slices are the data of this rank's chunks, and the small state (RNG streams,
iteration, rank 0's meta.json) is captured. A thread then writes the rank file into
``iter_X.tmp``. Rank files are written atomically (a temporary name, fsync, rename), so a
rank file there is that rank's "done" marker: rank 0's thread, after its own file, polls the
directory until every rank's file is in place, then writes meta.json and the chunk index,
renames the directory, points ``latest`` at it and prunes (``chunk_index.finish``). A crash
at any moment leaves ``latest`` where the synchronous save would: at a complete checkpoint.

Why files and not a collective say when every rank is done: ranks match collectives by the
order they are issued on a communicator (NCCL and gloo alike), and one issued from a second
thread lands between the training thread's own, in an order no rank controls; an agreement
on the training thread at every step would be a host sync on the hot path. The main threads
agree only where a save syncs anyway, in ``wait`` (at the next save, and before the run
exits): each rank waits for its own file and one all-reduce says whether any rank failed;
rank 0 then waits for its publication, and a second all-reduce says whether that failed. A
failure raises on every rank and the checkpoints published before stay. At most one save is
in flight: a save first waits for the one before, so the buffer is never overwritten while
it is written out.

The threads are daemons: a run that stops with an error does not wait for a save in flight,
which is then abandoned as a crash would abandon it (``latest`` unchanged).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from megatron3d.checkpoint import chunk_index, io
from megatron3d.errors import CheckpointError
from megatron3d.log import get_logger
from megatron3d.mpu import comm
from megatron3d.mpu.state import ParallelState

logger = get_logger(__name__)

_FIRST_POLL_S = 0.01  # rank 0 looks for the other ranks' files this soon after its own,
_LAST_POLL_S = 1.0  # then ever less often: at most once a second on a shared filesystem


@dataclass
class _Job:
    """One save in flight, as its thread reports it to the main thread."""

    iteration: int
    directory: Path  # the checkpoint once published
    written: threading.Event = field(default_factory=threading.Event)  # or failed
    cancel: threading.Event = field(default_factory=threading.Event)  # stop waiting for peers
    write_error: Exception | None = None
    publish_error: Exception | None = None  # rank 0's meta.json, rename, latest or pruning
    thread: threading.Thread | None = None


class BackgroundSave:
    """One rank's asynchronous saves: ``start`` after the checks, ``wait`` before the next
    save and before the run exits (every rank calls both at the same points)."""

    def __init__(self, state: ParallelState, device: torch.device) -> None:
        self._state, self._device = state, device  # NCCL reduces device tensors
        self._job: _Job | None = None

    def start(self, root: Path, payload: dict[str, Any], meta: dict[str, Any] | None,
              keep_last: int | None, series: str) -> None:
        """Start writing the rank file ``payload`` (its chunks' data in host memory, which
        stays untouched until ``wait``) into ``iter_X.SERIES.tmp`` (``series``), which exists
        on every rank by now; ``meta`` (rank 0's only) is published once every rank's file is
        there, then ``keep_last`` prunes."""
        assert self._job is None, "a save is in flight: wait() first"
        iteration = payload["iteration"]
        job = _Job(iteration, io.iteration_dir(root, iteration))
        job.thread = threading.Thread(target=self._run, args=(job, root, payload, meta,
                                                              keep_last, series),
                                      name=f"checkpoint-save-{iteration}", daemon=True)
        job.thread.start()
        self._job = job
        logger.info("saving checkpoint at iteration %d to %s in the background", iteration,
                    job.directory)

    def _run(self, job: _Job, root: Path, payload: dict[str, Any],
             meta: dict[str, Any] | None, keep_last: int | None, series: str) -> None:
        staging = io.staging_dir(root, job.iteration, series)
        try:
            with io.writing(root):
                io.write_rank(staging, self._state.world_rank, payload)
        except Exception as err:  # any failure is raised on the main thread by wait()
            job.write_error = err
        job.written.set()
        if meta is None or job.write_error is not None:
            return
        try:
            with io.writing(root):
                done = _all_written(staging, self._state.world_size, job.cancel)
            if done:
                chunk_index.finish(root, meta, keep_last)
        except Exception as err:  # raised on the main thread by wait()
            job.publish_error = err

    def wait(self) -> None:
        """Return once the save in flight (if any) is published. Every rank must call this
        at the same point: if any rank could not write its file, or rank 0 could not
        publish, it raises on every rank, and the checkpoints published before stay."""
        job, self._job = self._job, None
        if job is None:
            return
        assert job.thread is not None
        job.written.wait()
        if comm.any_rank(job.write_error is not None, self._state.world, self._device):
            job.cancel.set()
            job.thread.join()
            raise job.write_error or CheckpointError(
                f"another rank could not write its part of the checkpoint of iteration "
                f"{job.iteration} (its output says why): nothing was published and the "
                f"checkpoints already saved in {job.directory.parent} are kept")
        job.thread.join()
        if comm.any_rank(job.publish_error is not None, self._state.world, self._device):
            raise job.publish_error or CheckpointError(
                f"rank 0 could not publish the checkpoint of iteration {job.iteration} (its "
                f"output says why): the checkpoints already saved in {job.directory.parent} "
                "are kept")
        logger.info("saved checkpoint at iteration %d to %s", job.iteration, job.directory)


def _all_written(staging: Path, world_size: int, cancel: threading.Event) -> bool:
    """Wait until every rank's file is in ``staging`` (True) or ``cancel`` is set (False).
    The interval doubles from 10 ms to 1 s, so a slow rank costs few directory listings."""
    expected = {io.rank_file(staging, r).name for r in range(world_size)}
    delay = _FIRST_POLL_S
    while not expected <= set(os.listdir(staging)):
        if cancel.wait(delay):
            return False
        delay = min(2 * delay, _LAST_POLL_S)
    return True
