"""torchrun for job scripts: the job exits with the first failing rank's code and line.

    python tools/launch.py --nproc-per-node 8 pretrain_gpt.py FLAGS...   (torchrun's options)

torchrun alone exits 1 whenever a rank failed, whatever the rank returned, and prints its
own report and traceback beside every rank's copy of the same start-up error. This runs
torchrun (in this process, with the same options) and gives its ranks a directory in which a
failing rank records its ``error:`` line and exit code (``resilience/exit_record.py``) instead
of printing it. When the ranks are done, the earliest record's line is printed once and its
code is this process's exit code: 2 bad input, 3 a hang, 1 a run gone wrong. A rank that
failed without a record (a traceback, a signal) is named in one ``launch:`` line, with
torchrun's code for it (128 + N for signal N). One launcher per node, as torchrun. Under
the SLURM scripts a launcher whose ranks failed also notes its node (``resilience/node_exit``).
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from megatron3d.resilience import node_exit
from megatron3d.resilience.exit_record import EXIT_DIR_ENV, first_failure


def main(argv: Sequence[str] | None = None) -> int:
    args = torchrun.parse_args(list(sys.argv[1:] if argv is None else argv))
    _quiet_torchrun()
    with tempfile.TemporaryDirectory(prefix="megatron3d-exits-") as records:
        os.environ[EXIT_DIR_ENV] = records  # the ranks inherit the launcher's environment
        failed: ChildFailedError | None = None
        try:
            torchrun.run(args)
        except ChildFailedError as err:
            failed = err
        except SignalException as err:  # SIGTERM/SIGINT: torchrun stopped the ranks first
            return 128 + int(err.sigval)
        finally:
            del os.environ[EXIT_DIR_ENV]
        first = first_failure(Path(records))
    code, rank = _outcome(first, failed)
    node_exit.record(code, rank)
    return code


def _outcome(first: dict[str, Any] | None, failed: ChildFailedError | None) -> tuple[int, str]:
    """The exit code and the first failing rank, with that rank's one line printed."""
    if first is not None:
        sys.stderr.write(first["line"] + "\n")
        return int(first["code"]), str(first["rank"])
    if failed is None:
        return 0, ""
    rank, failure = failed.get_first_failure()
    if failure.exitcode < 0:
        sys.stderr.write(f"launch: rank {rank} was killed by signal {-failure.exitcode}\n")
        return 128 - failure.exitcode, str(rank)
    sys.stderr.write(f"launch: rank {rank} exited with code {failure.exitcode} without an "
                     "error line; its output above says why\n")
    return failure.exitcode, str(rank)


def _quiet_torchrun() -> None:
    """torchrun's agent logs each failed rank and the signals it sends the others: what the
    one line says already. Its loggers are named after its modules, each with its own level."""
    for name in list(logging.Logger.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


if __name__ == "__main__":
    sys.exit(main())
