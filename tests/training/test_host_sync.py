"""No host sync on the hot path: training steps 2..4 run with every device->host transfer
patched to raise, at ZeRO-0, 1 and 3, in fp32 and bf16 (DESIGN.md §9)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.helpers.runs import build
from tests.helpers.tiny import train_argv

SYNCS = ("item", "tolist", "cpu", "__bool__")


@contextlib.contextmanager
def _forbidden(allowed: set[int]):
    """Patch the transfers to raise, except on ``allowed`` tensors (the non-fused AdamW's
    step counters: host-side scalars by torch's design, on CUDA too)."""
    real = {name: getattr(torch.Tensor, name) for name in SYNCS}
    real_sync = torch.cuda.synchronize

    def guard(name: str):
        def patched(self, *args, **kwargs):
            if id(self) in allowed:
                return real[name](self, *args, **kwargs)
            raise AssertionError(f"host sync via Tensor.{name} during a training step")
        return patched

    def no_synchronize(*_args, **_kwargs):
        raise AssertionError("torch.cuda.synchronize during a training step")

    for name in SYNCS:
        setattr(torch.Tensor, name, guard(name))
    torch.cuda.synchronize = no_synchronize
    try:
        yield
    finally:
        for name, fn in real.items():
            setattr(torch.Tensor, name, fn)
        torch.cuda.synchronize = real_sync


def _steps_without_sync(*flags: str) -> int:
    trainer, _ = build(train_argv("gpt2", 4, "--log-interval", "100", *flags))
    stack = contextlib.ExitStack()
    done = []

    def on_step(iteration: int, _result) -> None:
        done.append(iteration)
        if iteration == 1:  # steps 2..4 run under the patch
            steps = {id(s["step"]) for s in trainer.optimizer.inner.state.values()}
            stack.enter_context(_forbidden(steps))

    trainer.on_step = on_step
    with stack:
        trainer.run()
    return len(done)


@pytest.mark.parametrize("precision", [(), ("--bf16",)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("zero", [0, 1, 3])
def test_training_steps_never_sync_with_the_host(zero, precision):
    flags = ("--zero-stage", str(zero), *precision)
    assert run_distributed(_steps_without_sync, 2, *flags) == [4, 4]
