"""Joining a launched job (the env:// rendezvous), bounded by its own timeout.

Every rank meets at MASTER_ADDR:MASTER_PORT (rank 0's store, or torchrun's) before the process
group exists. torch waits there with the collectives' timeout, so a stray WORLD_SIZE, a
wrong address or a rank 0 that never started looked like a 10-minute hang followed by a
traceback; here the wait is ``--rendezvous-timeout`` and its end is one ``ConfigError`` line
naming the variables to check.

Under torchrun every worker uses the agent's store, which outlives the workers: when
``--max-restarts`` restarts them after a failure, the new workers would read the keys the dead
ones wrote (gloo's addresses, so the new process group waits for processes that are gone; a
posted failure). Each restart of the workers (``TORCHELASTIC_RESTART_COUNT``) therefore gets
its own key space in that store.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import sys
import tempfile
from collections.abc import Iterator

import torch.distributed as dist

from megatron3d.errors import ConfigError


def join(rank: int, world_size: int, seconds: float) -> dist.Store:
    """The env:// store of a launched run, or ``ConfigError`` naming what did not come. The
    store's C++ client logs each failed try and its backtrace on stderr: held back while it
    tries, printed if it succeeds, dropped under the one line if it fails."""
    with _held_stderr():
        try:
            store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size,
                                               timeout=datetime.timedelta(seconds=seconds)))
        except dist.DistError as err:
            raise ConfigError(_problem(str(err), rank, world_size, seconds)) from None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        return store
    return dist.PrefixStore(f"megatron3d/attempt_{attempt}", store)


def _problem(message: str, rank: int, world_size: int, seconds: float) -> str:
    """The one line for the store's ``message``, naming the variables to check."""
    where = f"MASTER_ADDR={os.environ['MASTER_ADDR']} MASTER_PORT={os.environ['MASTER_PORT']}"
    joined = re.search(r"(\d+)/(\d+) clients joined", message)
    if "EADDRINUSE" in message:
        return (f"MASTER_PORT={os.environ['MASTER_PORT']} is in use on this host, so rank 0 "
                "cannot host the rendezvous there: set MASTER_PORT to a free port (torchrun: "
                "--master-port or --rdzv-endpoint HOST:PORT), or stop the process holding it")
    if joined:
        return (f"only {joined[1]} of {world_size} ranks joined the job at {where} within "
                f"--rendezvous-timeout {seconds:g} s: start WORLD_SIZE={world_size} ranks "
                "with the same MASTER_ADDR and MASTER_PORT (a stray WORLD_SIZE in this "
                "process's environment? unset it for one process), or raise "
                "--rendezvous-timeout when ranks start late")
    first = (message.splitlines() or [""])[0][:160]
    return (f"rank {rank} could not join the job at {where} within --rendezvous-timeout "
            f"{seconds:g} s ({first}): check that MASTER_ADDR and MASTER_PORT name rank 0's "
            "host and port and that rank 0 started, or raise --rendezvous-timeout when ranks "
            "start late")


@contextlib.contextmanager
def _held_stderr() -> Iterator[None]:
    """Point file descriptor 2 (where C++ logs go) at a temporary file for the block, then
    back: what was written comes out if the block succeeds and is dropped if it raises."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as file:
        os.dup2(file.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        file.seek(0)
        written = file.read()
    if written:
        os.write(2, written)
