"""A rank's error line and exit code, handed to the launcher that runs torchrun.

torchrun exits 1 whenever a rank failed, whatever the rank returned (2 for bad input, 3 for a
hang), and every rank prints the same start-up error. Under ``tools/launch.py`` (which sets
``EXIT_DIR_ENV`` for the ranks it starts) a failing rank writes its line and code to a file
there instead of printing the line; the launcher prints the first failing rank's line once and
exits with its code. Without the launcher the line is printed as before.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

EXIT_DIR_ENV = "MEGATRON3D_EXIT_DIR"


def report(code: int, line: str) -> None:
    """Say ``line`` (an ``error:`` line) for a process exiting with ``code``: record it for
    the launcher, or print it on stderr when there is none (or its directory is gone)."""
    directory = os.environ.get(EXIT_DIR_ENV)
    if directory:
        rank = os.environ.get("RANK", "")
        name = f"rank-{int(rank) if rank.isdigit() else 'unknown'}-{os.getpid()}.json"
        record = {"rank": rank, "code": code, "line": line, "time": time.time()}
        try:
            tmp = Path(directory) / (name + ".tmp")
            tmp.write_text(json.dumps(record))
            tmp.replace(tmp.with_name(name))  # the launcher reads whole records only
            return
        except OSError:
            pass
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def first_failure(directory: Path) -> dict[str, Any] | None:
    """The earliest record in ``directory`` (ties: the lowest rank), or None."""
    records = []
    for path in directory.glob("rank-*.json"):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    if not records:
        return None
    return min(records, key=lambda r: (r["time"], str(r["rank"]).zfill(12)))
