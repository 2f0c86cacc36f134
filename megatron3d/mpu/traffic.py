"""Instrumentation of collectives: observers that see every collective ``comm`` issues.

Kept apart from the parallel-state objects: an ``AxisGroup`` says who talks, not who listens.
``with observing(counter):`` attaches an observer for a block (a test, a benchmark's measured
steps); with none attached, ``notify`` is one empty-tuple check per collective. Like a
logger's handlers, the attached observers are process-wide.

Each operation is told twice: ``notify`` before it is posted (a call that blocks, such as a
collective waiting for a frozen peer, has then been seen), and ``posted`` once the call
returned, with what tells when it is done: the backend's work, or None for a blocking call
(done on the host; on a GPU only queued behind the current stream). Only observers that
define ``posted`` (a flight recorder) are told the second time; they keep the work, never
wait on it.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from megatron3d.mpu.state import AxisGroup

Observer = Callable[[str, torch.Tensor, "AxisGroup", "int | None", object], None]
"""(kind, the tensor this rank contributes, the axis, the peer's global rank for a send or
receive and the source's for a broadcast (else None), the caller's tag (e.g. which ZeRO unit
or micro-batch), or None) for each operation issued."""

_observers: tuple[Observer, ...] = ()
_completion: tuple[Callable[[Sequence[object]], None], ...] = ()  # attached ``posted`` methods
_RETURNED = (None,)


@contextlib.contextmanager
def observing(observer: Observer) -> Iterator[Observer]:
    """Call ``observer`` for every collective issued inside the block (and its ``posted``
    method, if it has one, once each is posted)."""
    global _observers, _completion  # noqa: PLW0603 - the registry, like log handlers
    completion = getattr(observer, "posted", None)
    _observers = (*_observers, observer)
    _completion = (*_completion, completion) if completion is not None else _completion
    try:
        yield observer
    finally:
        _observers = tuple(o for o in _observers if o is not observer)
        _completion = tuple(c for c in _completion if c != completion)


def notify(kind: str, tensor: torch.Tensor, axis: AxisGroup, peer: int | None = None,
           tag: object = None) -> None:
    """An operation is about to be posted."""
    for observer in _observers:
        observer(kind, tensor, axis, peer, tag)


def posted(works: Sequence[object]) -> None:
    """The last ``len(works)`` operations notified were posted: each one's work (which has
    ``is_completed()``), in the order notified."""
    for observer in _completion:
        observer(works)


def returned() -> None:
    """The operation just notified was a blocking call, and it returned."""
    for observer in _completion:
        observer(_RETURNED)


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


class CrossNodeCounter:
    """Bytes this rank receives from ranks on other nodes, per axis name, under each
    operation's logical algorithm (whatever the backend does underneath: gloo builds
    gathers from all-reduces, which is not what a cluster's NCCL sends):

    - all-gather: the chunk, from each member on another node;
    - reduce-scatter, all-to-all: 1/size of the tensor from each such member;
    - all-reduce: twice that (a reduce-scatter, then an all-gather of the sums);
    - receive, broadcast: the tensor, when the sender (the source) is on another node.

    A send counts at its receiver, so the sum over ranks is what crosses between nodes.
    Nodes are as torchrun numbers ranks: node = rank // ranks_per_node.
    """

    def __init__(self, ranks_per_node: int, world_rank: int) -> None:
        self.bytes: defaultdict[str, int] = defaultdict(int)
        self._per_node, self._node = ranks_per_node, world_rank // ranks_per_node

    def __call__(self, kind: str, tensor: torch.Tensor, axis: AxisGroup,
                 peer: int | None = None, tag: object = None) -> None:
        size = tensor.numel() * tensor.element_size()
        if kind in ("recv", "broadcast"):
            if peer is not None and peer // self._per_node != self._node:
                self.bytes[axis.name] += size
            return
        if kind == "all_gather":
            share = size  # each member's chunk
        elif kind in ("reduce_scatter", "all_to_all"):
            share = size // axis.size
        elif kind == "all_reduce":
            share = 2 * (size // axis.size)
        else:  # a send (counted where it arrives), a barrier
            return
        elsewhere = sum(1 for r in axis.ranks if r // self._per_node != self._node)
        if elsewhere:
            self.bytes[axis.name] += share * elsewhere

    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    def reset(self) -> None:
        self.bytes.clear()
