"""``pretrain_gpt.main`` with one fault injected on one rank, for the hang tests.

    FAULT=skip-send|sleep|stop FAULT_RANK=R FAULT_STEP=K python tests/helpers/faulty_run.py ARGS

The fault is installed from outside (monkeypatching this process), so no test seam lives in
the framework:
- ``skip-send``: at step K, rank R drops the sends of its first pipeline exchange that has any;
- ``sleep``: at step K, rank R sleeps inside its first forward pass;
- ``stop``: at step K, rank R writes its pid to ``$FAULT_PID_FILE`` (the test then freezes it
  with SIGSTOP from outside) and carries on;
- ``flag``: rank R is launched with ``$FAULT_FLAG $FAULT_VALUE`` instead of the given value.
Every rank writes ``$FAULT_DIR/steps-<rank>`` after each step, so a test can wait for
progress (e.g. to send SIGUSR2 mid-run). A rank whose watchdog fired waits ``EXIT_GRACE_S``
(below) before exiting rather than the framework's 5 s.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pretrain_gpt  # noqa: E402
from megatron3d.mpu import comm  # noqa: E402
from megatron3d.pipeline.engine import PipelineEngine  # noqa: E402
from megatron3d.resilience import watchdog  # noqa: E402
from megatron3d.resilience.watchdog import Watchdog  # noqa: E402

RANK = int(os.environ.get("RANK", "0"))
FAULT = os.environ.get("FAULT", "")
FAULTY = int(os.environ.get("FAULT_RANK", "-1")) == RANK
FAULT_STEP = int(os.environ.get("FAULT_STEP", "0"))
_step = {"n": 0, "armed": True}  # steps begun on this rank; fault not used yet
# The grace lets the peers' watchdogs fire before this rank's exit breaks their collectives.
# In these jobs all ranks fire within 0.2 s of each other (measured from the exit times), so
# 2 s keeps a wide margin and saves 3 s a hang test.
EXIT_GRACE_S = 2.0


def _install() -> None:
    forward_backward = PipelineEngine.forward_backward
    forward = PipelineEngine._forward
    start_exchange = comm.start_exchange
    beat = Watchdog.beat

    def counting_forward_backward(self, *args, **kwargs):
        _step["n"] += 1
        if FAULTY and FAULT == "stop" and _step["n"] == FAULT_STEP:
            Path(os.environ["FAULT_PID_FILE"]).write_text(str(os.getpid()))
            time.sleep(0.5)  # give the test time to stop this process mid-step
        return forward_backward(self, *args, **kwargs)

    def faulty_start_exchange(sends, recvs, axis):
        if (FAULT == "skip-send" and _step["n"] == FAULT_STEP and sends and _step["armed"]):
            _step["armed"] = False
            sends = []
        return start_exchange(sends, recvs, axis)

    def faulty_forward(self, *args, **kwargs):
        if FAULT == "sleep" and _step["n"] == FAULT_STEP and _step["armed"]:
            _step["armed"] = False
            time.sleep(3600)
        return forward(self, *args, **kwargs)

    def reporting_beat(self, iteration):  # told after every step
        marker = Path(os.environ.get("FAULT_DIR", ".")) / f"steps-{RANK}"
        marker.write_text(str(iteration))
        return beat(self, iteration)

    watchdog.EXIT_GRACE_S = EXIT_GRACE_S
    PipelineEngine.forward_backward = counting_forward_backward
    Watchdog.beat = reporting_beat
    if FAULTY:
        comm.start_exchange = faulty_start_exchange
        PipelineEngine._forward = faulty_forward


def _argv() -> list[str]:
    argv = sys.argv[1:]
    if FAULTY and FAULT == "flag":
        argv[argv.index(os.environ["FAULT_FLAG"]) + 1] = os.environ["FAULT_VALUE"]
    return argv


if __name__ == "__main__":
    _install()
    sys.exit(pretrain_gpt.main(_argv()))
