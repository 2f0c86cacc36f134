"""Gradient faults injected from outside the framework (no test seam in core objects)."""

from __future__ import annotations

from collections.abc import Callable

import torch


class CorruptAfterReduce:
    """Wraps a trainer's ``GradSync``: after the gradient reduction of step ``at``, the first
    element of ``target()`` becomes ``value`` on this rank if ``on_rank`` (a fault only this
    rank sees, e.g. an fp16 overflow or a NaN from bad hardware)."""

    def __init__(self, inner, target: Callable[[], torch.Tensor], at: int, on_rank: bool,
                 value: float) -> None:
        self.inner, self.target, self.at, self.on_rank = inner, target, at, on_rank
        self.value = value
        self.calls = 0

    def before_last_backward(self, chunk: int) -> None:
        self.inner.before_last_backward(chunk)

    def __call__(self) -> None:
        self.inner()
        self.calls += 1
        if self.calls == self.at and self.on_rank:
            self.target().view(-1)[0] = self.value
