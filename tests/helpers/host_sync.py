"""A context in which every device -> host transfer raises: the hot-path rule of
docs/ARCHITECTURE.md §5 made checkable (``.item()``, ``.tolist()``, ``.cpu()``,
``bool(tensor)``, cuda synchronize); ``GuardedSteps`` puts a trainer's steps under it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

SYNCS = ("item", "tolist", "cpu", "__bool__")


@contextlib.contextmanager
def no_host_sync():
    """Patch every device -> host transfer to raise."""
    real = {name: getattr(torch.Tensor, name) for name in SYNCS}
    real_sync = torch.cuda.synchronize

    def guard(name: str):
        def patched(self, *args, **kwargs):
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


class GuardedSteps:
    """A trainer's heartbeat and ``on_step`` hook that run its steps under ``no_host_sync``
    from the end of step 1 (whose first calls may set things up) until the hooks of step
    ``last``: each step, its log and TensorBoard bookkeeping and its exit check. The slower
    work the loop announces through the heartbeat (evaluation, a checkpoint save) may sync,
    as may the end of the run (the exit watch agrees at once after the last step)."""

    def __init__(self, last: int) -> None:
        self.last = last
        self.guarded: list[int] = []  # the iterations whose step ran under the guard
        self._stack = contextlib.ExitStack()
        self._on = False

    def starting(self, iteration: int) -> None:
        pass

    def beat(self, iteration: int) -> None:
        if self._on:
            self.guarded.append(iteration)
        elif iteration == 1:
            self._guard()

    def on_step(self, iteration: int, _result: object) -> None:
        if iteration == self.last:
            self._stack.close()
            self._on = False

    @contextlib.contextmanager
    def allowance(self, phase: str) -> Iterator[None]:
        """``phase`` (evaluation, checkpoint save) may sync."""
        on, self._on = self._on, False
        self._stack.close()
        try:
            yield
        finally:
            if on:
                self._guard()

    def _guard(self) -> None:
        self._stack.enter_context(no_host_sync())
        self._on = True
