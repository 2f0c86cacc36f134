"""No host sync on the hot path (docs/ARCHITECTURE.md §5): training steps 2..6 run with every
device->host transfer patched to raise, with every per-step option on: checkpoints (saved
with host syncs allowed, as a save may; the steps between run guarded, a background write
going on with --async-save), evaluation (allowed to sync), TensorBoard every step, and the
exit checks (signals, --exit-duration-in-mins, --kill-switch-path), which agree across ranks
every step. ZeRO-0, 1 and 3, one and two pipeline stages, fp32 and bf16, context parallelism."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from megatron3d.mpu import traffic
from megatron3d.resilience.flight_recorder import FlightRecorder
from megatron3d.training.build import Overrides
from tests.helpers.dist import run_distributed
from tests.helpers.host_sync import GuardedSteps
from tests.helpers.runs import build
from tests.helpers.tiny import train_argv

ITERS = 6


def _every_option(directory: Path) -> tuple[str, ...]:
    """Saves at 2, 4, 6, evaluation at 3, 6, TensorBoard every step, the exit checks."""
    return ("--save", str(directory / "ckpt"), "--save-interval", "2", "--eval-interval", "3",
            "--tensorboard-dir", str(directory / "tb"), "--tensorboard-log-interval", "1",
            "--exit-duration-in-mins", "1000", "--kill-switch-path", str(directory / "stop"))


def _steps_without_sync(*flags: str, recorded: bool = False) -> dict:
    """The iterations that ran guarded, and how many exit checks this rank took part in."""
    stack = contextlib.ExitStack()
    observers = ()
    if recorded:  # as pretrain_gpt.py runs: flight recorder attached, watchdog heartbeats
        recorder = FlightRecorder(64)
        stack.enter_context(traffic.observing(recorder))
        observers = (recorder,)
    checks = []
    stack.enter_context(traffic.observing(
        lambda kind, t, axis, peer, tag: tag == "exit watch" and checks.append(kind)))
    guard = GuardedSteps(last=ITERS)
    trainer, _ = build(train_argv("gpt2", ITERS, "--log-interval", "100", *flags),
                       Overrides(observers=observers), heartbeat=guard, on_step=guard.on_step)
    with stack:
        trainer.run()
    return {"guarded": guard.guarded, "checks": len(checks)}


LAYOUTS = [(0, 1, ()), (0, 2, ("--bf16", "--async-save")), (1, 1, ("--bf16", "--async-save")),
           (1, 2, ()), (3, 1, ("--async-save",)), (3, 2, ("--bf16",)),
           (1, 1, ("--context-parallel-size", "2"))]  # the loss's token count over CP


@pytest.mark.parametrize("zero, pp, extra", LAYOUTS,
                         ids=[f"zero{z}-pp{p}-" + ("-".join(f.strip("-") for f in e) or "fp32")
                              for z, p, e in LAYOUTS])
def test_training_steps_never_sync_with_the_host(tmp_path, zero, pp, extra):
    """Mutation: the exit watch's former blocking all-reduce read with ``.tolist()`` every
    step fails here (as would a save, evaluation or TensorBoard write that synced outside
    its allowance)."""
    flags = ("--zero-stage", str(zero), "--pipeline-model-parallel-size", str(pp), *extra,
             *_every_option(tmp_path))
    for rank in run_distributed(_steps_without_sync, 2 * pp, *flags, timeout_s=120):
        # one check as training starts and one after each step, the last read at once
        assert rank == {"guarded": list(range(2, ITERS + 1)), "checks": ITERS + 1}, rank


def test_the_flight_recorder_never_syncs_with_the_host():
    flags = ("--zero-stage", "3", "--pipeline-model-parallel-size", "2")
    for rank in run_distributed(_steps_without_sync, 4, *flags, recorded=True):
        assert rank == {"guarded": list(range(2, ITERS + 1)), "checks": 0}, rank
