"""The ranks of one ``tests/helpers/launch.py`` job, forked from one process that imported
torch once:

    python tests/helpers/rank_zygote.py WORLD_SIZE SCRIPT ARGS...   (cwd and env: the job's)

Why: most of a tiny rank's start is importing torch and ``torch._dynamo`` (torch.optim's step
imports it): about 3.5 CPU-seconds a rank, which on CI's 2 cores is most of what an end-to-end
test waits for. Here they are imported once per job; nothing else runs before the fork (no
thread, no process group, nothing of megatron3d), so each rank still starts clean.

Each child becomes rank r as ``python SCRIPT ARGS`` would start it: RANK and LOCAL_RANK set,
stdout and stderr to ``rank-r.log``, ``__main__`` run from SCRIPT with its own sys.argv and
sys.path[0]; it leaves through the interpreter's ordinary exit (exit code, exceptions, atexit,
signals as in any process). This process reports on its stdout one ``start R PID`` line per
rank, then one ``exit R CODE`` line (Popen's returncode: negative for a signal) as each ends,
and exits once all have.
"""

from __future__ import annotations

import os
import runpy
import sys

import torch  # noqa: F401  (the point: imported before the fork)
import torch._dynamo  # noqa: F401
import torch.distributed  # noqa: F401


def _report(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _fork_ranks(world_size: int) -> int | None:
    """Start the ranks, each with its log open on stdout and stderr (the file exists before
    its start is reported); in a child return its rank, here None once all have ended."""
    sys.stdout.flush()
    ranks = {}
    for rank in range(world_size):
        log = os.open(f"rank-{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        pid = os.fork()
        if pid == 0:
            for fd in (1, 2):
                os.dup2(log, fd)
            os.close(log)
            return rank
        os.close(log)
        ranks[pid] = rank
        _report(f"start {rank} {pid}")
    while ranks:
        pid, status = os.waitpid(-1, 0)
        if pid in ranks:
            _report(f"exit {ranks.pop(pid)} {os.waitstatus_to_exitcode(status)}")
    return None


def _become(rank: int, script: str, args: list[str]) -> None:
    os.environ["RANK"] = os.environ["LOCAL_RANK"] = str(rank)
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    me = _fork_ranks(int(sys.argv[1]))
    if me is not None:
        _become(me, sys.argv[2], sys.argv[3:])
