"""Run a function on N gloo processes and collect what each rank returns.

Why not a private torch test base: this stays small, starts workers from a fork server that
has imported torch and megatron3d once and run nothing (no inherited state, and no second of
imports per worker: the suite starts a few hundred of them), rendezvous through a ``file://``
store in a fresh temporary directory (no TCP port races between concurrent test runs),
forwards every rank's exception with its traceback, and kills everything on a timeout instead
of hanging the suite.

``fn`` must be importable (defined at module level); its arguments and return value must be
picklable. Results travel as plain pickled bytes, so workers may exit right after replying.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import queue
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

_POLL_S = 0.2
_GRACE_S = 2.0  # how long a dead worker's last message may take to arrive


class RankError(RuntimeError):
    """A worker raised; carries its rank, the exception type name and formatted traceback."""

    def __init__(self, rank: int, exc_type: str, traceback_text: str) -> None:
        super().__init__(f"rank {rank} raised {exc_type}:\n{traceback_text}")
        self.rank, self.exc_type, self.traceback_text = rank, exc_type, traceback_text


def _worker(rank: int, world_size: int, init_file: str, backend: str, fn: Callable[..., Any],
            args: tuple, kwargs: dict, replies: Any) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size)
        result = pickle.dumps(fn(*args, **kwargs))
    except BaseException as exc:  # anything, even SystemExit, goes to the parent
        # Reply before tearing down: peers blocked on this rank then fail only after the
        # parent already holds the root cause.
        replies.put((rank, "error", pickle.dumps((type(exc).__name__, traceback.format_exc()))))
        return
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    replies.put((rank, "ok", result))  # the parent kills the worker once all have replied


def _collect(procs: list, replies: Any, timeout_s: float) -> list:
    """Wait for one reply per rank; raise on the first error, a silent death or the deadline."""
    world_size = len(procs)
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    dead_since: dict[int, float] = {}
    while len(results) < world_size:
        now = time.monotonic()
        if now > deadline:
            missing = sorted(set(range(world_size)) - set(results))
            raise TimeoutError(f"distributed test exceeded {timeout_s:.1f}s; "
                               f"ranks still running: {missing}")
        try:
            rank, status, payload = replies.get(timeout=min(_POLL_S, deadline - now + 1e-3))
        except queue.Empty:
            _check_deaths(procs, results, dead_since)
            continue
        if status == "error":
            raise RankError(rank, *pickle.loads(payload))
        results[rank] = pickle.loads(payload)
    return [results[r] for r in range(world_size)]


def _check_deaths(procs: list, results: dict, dead_since: dict) -> None:
    for rank, proc in enumerate(procs):
        if rank in results or proc.exitcode is None:
            continue
        first_seen = dead_since.setdefault(rank, time.monotonic())
        if time.monotonic() - first_seen > _GRACE_S:
            raise RankError(rank, "ProcessExit",
                            f"worker exited with code {proc.exitcode} without replying")


# torch._dynamo: torch.optim's Optimizer imports it on its first construction, a CPU-second
# in every worker that builds one; inductor's compiler, 1.5 CPU-seconds more in every
# worker of a --compile test. Imported once here, every worker inherits them.
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch._inductor.compile_fx",
            "megatron3d.training.build", "tests.helpers.runs"]


def _context() -> Any:
    """The fork-server context, its server importing ``_PRELOAD`` when first started."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any,
                    timeout_s: float = 120.0, backend: str = "gloo", **kwargs: Any) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks (gloo unless ``backend`` says
    nccl: one GPU per rank); return results by rank.

    Raises ``RankError`` (rank number and traceback) when any rank raises, and
    ``TimeoutError`` when the ranks are not all done within ``timeout_s``; in every case all
    workers are killed and the rendezvous directory removed before returning.
    """
    ctx = _context()
    tmpdir = tempfile.mkdtemp(prefix="m3d_dist_")
    init_file = os.path.join(tmpdir, "store")
    replies = ctx.Queue()
    procs = [ctx.Process(target=_worker, daemon=False, name=f"m3d-rank{rank}",
                         args=(rank, world_size, init_file, backend, fn, args, kwargs,
                               replies))
             for rank in range(world_size)]
    try:
        for proc in procs:
            proc.start()
        return _collect(procs, replies, timeout_s)
    finally:
        _stop(procs)
        replies.close()
        replies.join_thread()
        shutil.rmtree(tmpdir, ignore_errors=True)


def _stop(procs: list) -> None:
    """Kill every worker: after replying they only have interpreter shutdown left to do."""
    for proc in procs:
        if proc.is_alive():
            proc.kill()
        with contextlib.suppress(AssertionError):  # never started
            proc.join(timeout=5.0)
