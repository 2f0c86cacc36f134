"""What several benchmarks share: gloo worker processes, and the model-shape flags."""

from __future__ import annotations

import argparse
import multiprocessing as mp
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def add_model_args(p: argparse.ArgumentParser, *, layers: int | None = 4, hidden: int = 256,
                   heads: int = 8, seq: int = 128, micro_batch: int = 2,
                   vocab: int = 8192) -> None:
    """The GPT shape flags every benchmark takes, with that benchmark's defaults (no
    ``--layers`` when the benchmark derives the depth itself)."""
    if layers is not None:
        p.add_argument("--layers", type=int, default=layers)
    p.add_argument("--hidden", type=int, default=hidden)
    p.add_argument("--heads", type=int, default=heads)
    p.add_argument("--seq", type=int, default=seq)
    p.add_argument("--micro-batch", type=int, default=micro_batch)
    p.add_argument("--vocab", type=int, default=vocab)


def _worker(rank: int, world: int, init: str, fn: Callable[..., Any], args: tuple,
            replies: Any) -> None:
    torch.set_num_threads(1)  # k ranks share the machine's cores
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        replies.put((rank, True, fn(*args)))
    except Exception:  # the parent prints it
        replies.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = 300.0) -> list:
    """Run ``fn(*args)`` on ``world`` gloo ranks (file:// rendezvous); results by rank."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="m3d_bench_") as tmp:
        replies = ctx.Queue()
        procs = [ctx.Process(target=_worker, args=(r, world, f"file://{tmp}/store", fn, args,
                                                   replies)) for r in range(world)]
        for proc in procs:
            proc.start()
        try:
            return _collect(procs, replies, time.monotonic() + timeout_s)
        finally:
            for proc in procs:
                proc.join(timeout=10.0)
                if proc.is_alive():
                    proc.kill()


def _collect(procs: list, replies: Any, deadline: float) -> list:
    results: dict[int, Any] = {}
    while len(results) < len(procs):
        if time.monotonic() > deadline:
            raise TimeoutError(f"ranks {sorted(set(range(len(procs))) - set(results))} hung")
        try:
            rank, ok, payload = replies.get(timeout=1.0)
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if r not in results and p.exitcode]
            if dead:
                raise RuntimeError(f"ranks {dead} died without replying") from None
            continue
        if not ok:
            raise RuntimeError(f"rank {rank} failed:\n{payload}")
        results[rank] = payload
    return [results[r] for r in range(len(procs))]
