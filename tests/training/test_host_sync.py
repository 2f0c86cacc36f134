"""No host sync on the hot path: training steps 2..4 run with every device->host transfer
patched to raise, at ZeRO-0, 1 and 3, in fp32 and bf16 (docs/ARCHITECTURE.md §5)."""

from __future__ import annotations

import contextlib

import pytest

from megatron3d.mpu import traffic
from megatron3d.resilience.flight_recorder import FlightRecorder
from megatron3d.training.build import Overrides
from tests.helpers.dist import run_distributed
from tests.helpers.host_sync import no_host_sync
from tests.helpers.runs import build
from tests.helpers.tiny import train_argv


def _steps_without_sync(*flags: str, recorded: bool = False) -> int:
    stack = contextlib.ExitStack()
    done = []
    observers = ()
    if recorded:  # as pretrain_gpt.py runs: flight recorder attached, watchdog heartbeats
        recorder = FlightRecorder(64)
        stack.enter_context(traffic.observing(recorder))
        observers = (recorder,)

    def on_step(iteration: int, _result) -> None:
        done.append(iteration)
        if iteration == 1:  # steps 2..4 run under the patch
            stack.enter_context(no_host_sync())

    trainer, _ = build(train_argv("gpt2", 4, "--log-interval", "100", *flags),
                       Overrides(observers=observers), on_step=on_step)
    with stack:
        trainer.run()
    return len(done)


@pytest.mark.parametrize("precision", [(), ("--bf16",)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("zero", [0, 1, 3])
def test_training_steps_never_sync_with_the_host(zero, precision):
    flags = ("--zero-stage", str(zero), *precision)
    assert run_distributed(_steps_without_sync, 2, *flags) == [4, 4]


def test_the_flight_recorder_never_syncs_with_the_host():
    flags = ("--zero-stage", "3", "--pipeline-model-parallel-size", "2")
    assert run_distributed(_steps_without_sync, 4, *flags, recorded=True) == [4] * 4
