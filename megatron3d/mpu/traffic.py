"""Instrumentation of collectives: observers that see every collective ``comm`` issues.

Kept apart from the parallel-state objects: an ``AxisGroup`` says who talks, not who listens.
``with observing(counter):`` attaches an observer for a block (a test, a benchmark's measured
steps); with none attached, ``notify`` is one empty-tuple check per collective. Like a
logger's handlers, the attached observers are process-wide.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from megatron3d.mpu.state import AxisGroup

Observer = Callable[[str, torch.Tensor, "AxisGroup", "int | None", object], None]
"""(kind, the tensor this rank contributes, the axis, the peer's global rank for a send or
receive (else None), the caller's tag (e.g. which ZeRO unit or micro-batch), or None) for
each operation issued."""

_observers: tuple[Observer, ...] = ()


@contextlib.contextmanager
def observing(observer: Observer) -> Iterator[Observer]:
    """Call ``observer`` for every collective issued inside the block."""
    global _observers  # noqa: PLW0603 - the registry of attached observers, like log handlers
    _observers = (*_observers, observer)
    try:
        yield observer
    finally:
        _observers = tuple(o for o in _observers if o is not observer)


def notify(kind: str, tensor: torch.Tensor, axis: AxisGroup, peer: int | None = None,
           tag: object = None) -> None:
    for observer in _observers:
        observer(kind, tensor, axis, peer, tag)


class CommCounter:
    """Bytes and calls per collective kind, as issued by this rank.

    Bytes are those of the tensor this rank contributes (its input), so an all-reduce of an
    [s, b, h] activation counts s*b*h*element_size once per call. Size-1 axes count nothing:
    they communicate nothing. ``only``: count just the collectives on these axes.
    """

    def __init__(self, only: tuple[AxisGroup, ...] = ()) -> None:
        self.bytes: defaultdict[str, int] = defaultdict(int)
        self.calls: defaultdict[str, int] = defaultdict(int)
        self._groups = [axis.group for axis in only]

    def __call__(self, kind: str, tensor: torch.Tensor, axis: AxisGroup,
                 peer: int | None = None, tag: object = None) -> None:
        if self._groups and not any(axis.group is g for g in self._groups):
            return
        self.bytes[kind] += tensor.numel() * tensor.element_size()
        self.calls[kind] += 1

    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()

    def __repr__(self) -> str:
        return f"CommCounter(bytes={dict(self.bytes)}, calls={dict(self.calls)})"
