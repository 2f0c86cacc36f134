"""``pretrain_gpt.main`` that reports what a kill-and-recover run needs to see from outside.

    RECOVERY_DIR=D PYTHONPATH=REPO torchrun ... --module benchmarks.recovery_worker ARGS

Each worker writes, under ``D``:
- ``pid-<attempt>-<rank>``: its process id, for each restart of the workers
  (``TORCHELASTIC_RESTART_COUNT``; the torchrun agent's pid is not a worker's, so whoever
  kills a rank reads it here);
- ``steps-<rank>.jsonl``: one line per finished step: the attempt, the iteration, the wall
  time, and the step's loss at full precision (``repr`` of the float, on the last pipeline
  stage; None elsewhere), where the log line's six digits could not show a bitwise
  difference (reading it syncs with the device: this is a measuring run).
Installed from outside (wrapping ``build_trainer`` in this process), so no seam lives in the
framework.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import pretrain_gpt  # the repository's entry point: PYTHONPATH holds the repository
from megatron3d.training.build import Overrides
from megatron3d.training.step import StepResult

RANK = int(os.environ.get("RANK", "0"))
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
OUT = Path(os.environ.get("RECOVERY_DIR", "."))


def _install() -> None:
    build_trainer = pretrain_gpt.build_trainer
    steps = OUT / f"steps-{RANK}.jsonl"

    def reporting_build(cfg, state, dev, started=None, overrides=None):
        last_stage = state.pp.rank == state.pp.size - 1

        def on_step(iteration: int, result: StepResult) -> None:
            loss = repr(float(result.loss)) if last_stage else None
            with open(steps, "a") as out:
                out.write(json.dumps({"attempt": ATTEMPT, "iteration": iteration,
                                      "time": time.time(), "loss": loss}) + "\n")

        given = overrides or Overrides()
        hooks = dataclasses.replace(given.hooks, on_step=on_step)
        return build_trainer(cfg, state, dev, started, dataclasses.replace(given, hooks=hooks))

    (OUT / f"pid-{ATTEMPT}-{RANK}").write_text(str(os.getpid()))
    pretrain_gpt.build_trainer = reporting_build


if __name__ == "__main__":
    _install()
    sys.exit(pretrain_gpt.main(sys.argv[1:]))
