"""``pretrain_gpt.main`` whose rank files are written late, for the --async-save crash tests.

    SLOW_SAVE_S=T [SLOW_SAVE_RANK=R] [SIGTERM_AT_SAVE=N] python tests/helpers/slow_save_run.py ARGS

Before writing its rank file, rank R (every rank when unset) sleeps T seconds; with
SIGTERM_AT_SAVE, the process then sends itself SIGTERM before it writes the rank file of
iteration N, as the launcher forwarding the preemption signal mid-save would. Installed from
outside (monkeypatching ``io.write_rank`` in this process), so no test seam lives in the
framework.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pretrain_gpt  # noqa: E402
from megatron3d.checkpoint import io  # noqa: E402

DELAY_S = float(os.environ.get("SLOW_SAVE_S", "0"))
SLOW = os.environ.get("SLOW_SAVE_RANK", os.environ.get("RANK", "0")) == os.environ.get(
    "RANK", "0")
SIGTERM_AT = int(os.environ.get("SIGTERM_AT_SAVE", "-1"))


def _install() -> None:
    write_rank = io.write_rank

    def slow_write(directory: Path, rank: int, payload: dict[str, Any]) -> None:
        if SLOW:
            time.sleep(DELAY_S)
        if payload["iteration"] == SIGTERM_AT:
            os.kill(os.getpid(), signal.SIGTERM)
        write_rank(directory, rank, payload)

    io.write_rank = slow_write


if __name__ == "__main__":
    _install()
    sys.exit(pretrain_gpt.main(sys.argv[1:]))
