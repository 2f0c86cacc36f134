"""The communication flight recorder: the last N operations this rank issued, for hang dumps,
and which of them completed.

It is attached twice: as a ``traffic`` observer it sees every collective and point-to-point
operation ``mpu/comm.py`` issues, and as a pipeline-engine observer it knows which schedule
instruction (and so which micro-batch) is running. Recording appends one tuple to a bounded
deque and touches no tensor data (shape and dtype are metadata), so it costs a few
microseconds per operation and never syncs with the device; everything is formatted only
when a dump is written.

Completion: on a GPU the host runs ahead of the device, so the operations issued say little
about where a rank is stuck. When an operation is posted (``traffic.posted``) the recorder
keeps what tells when it is done: the backend's work, or for a blocking call a marker on the
current stream (``device.stream_marker``: on a GPU the call returned once queued; on CPU it
is done). Nothing is asked on the hot path: ``poll()``, run by the watchdog thread a few
times a second and before a dump, asks each pending one ``is_completed()`` (a query, never a
wait) and lets go of those done, since a work holds its tensors alive.

Sequence numbers are what make dumps of different ranks comparable: collectives are numbered
per process group (every member issues the same sequence), sends and receives per (group,
direction, peer), so rank a's k-th send to b is the message b's k-th receive from a waits for.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from megatron3d.pipeline.instructions import Backward, Exchange, Forward, Instruction

if TYPE_CHECKING:
    from megatron3d.mpu.state import AxisGroup

P2P_KINDS = ("send", "recv")


class Op(NamedTuple):
    seq: int  # operations this rank issued before this one
    time: float  # wall clock (time.time()) when issued
    kind: str  # all_reduce, all_gather, reduce_scatter, broadcast, barrier, send, recv
    group: str  # the axis name: tp, pp, dp, mp, embedding, world
    ranks: tuple[int, ...]  # the group's global ranks
    group_seq: int  # per group (collectives) or per (group, kind, peer) (send/recv)
    peer: int | None  # global rank of the other side of a send or receive, a broadcast's source
    shape: tuple[int, ...]
    dtype: torch.dtype
    iteration: int  # the training step in progress (0 before the first)
    program: int  # engine programs begun so far (training and evaluation batches)
    step: int | None  # index of the running instruction in that program, None outside
    instruction: Instruction | None
    tag: Any  # what the caller said it serves: ("unit", 3), ("bucket", 0), ("F", 2) ...


class FlightRecorder:
    """Ring buffer of ``Op``; call it as a traffic observer, give it to the engine too.

    ``marker``: for a device whose host runs ahead, makes a check that turns true once the
    current stream passes this point (``device.stream_marker``); None where a blocking call
    that returned is done (CPU)."""

    def __init__(self, size: int, marker: Callable[[], Callable[[], bool]] | None = None) -> None:
        self.ops: collections.deque[Op] = collections.deque(maxlen=max(size, 1))
        self.iteration = 0  # set by whoever drives the steps (the watchdog's heartbeat)
        self._marker = marker
        # seq -> whether it is done now, for every operation in the ring not seen done: from
        # its issue (_unposted: its call is running, or raised) until posted (its work's
        # is_completed, or a stream mark) and polled done. Each update is one dict operation,
        # atomic for the poller thread; the poller only removes entries that answered True,
        # which an operation still being posted never does.
        self._pending: dict[int, Callable[[], bool]] = {}
        self._seq = 0
        self._counts: dict[tuple, int] = {}
        self._program_count = 0
        self._program: list[Instruction] = []
        self._pos: int | None = None

    # -- traffic observer -------------------------------------------------------------------
    def __call__(self, kind: str, tensor: torch.Tensor, axis: AxisGroup,
                 peer: int | None = None, tag: Any = None) -> None:
        key = (id(axis.group), kind, peer) if kind in P2P_KINDS else id(axis.group)
        group_seq = self._counts.get(key, 0)
        self._counts[key] = group_seq + 1
        pos = self._pos
        instruction = self._program[pos] if pos is not None and pos < len(self._program) else None
        self.ops.append(Op(self._seq, time.time(), kind, axis.name, axis.ranks, group_seq, peer,
                           tuple(tensor.shape), tensor.dtype, self.iteration,
                           self._program_count, pos, instruction, tag))
        self._pending[self._seq] = _unposted
        self._seq += 1

    def posted(self, works: Sequence[Any]) -> None:
        """The last ``len(works)`` operations were posted (comm posts right after telling):
        keep each one's work; None is a blocking call that returned, done unless a stream
        mark must tell. An operation whose call raised stays unposted: not done."""
        pending, seq = self._pending, self._seq - len(works)
        for work in works:
            if work is not None:
                pending[seq] = work.is_completed
            elif self._marker is not None:
                pending[seq] = self._marker()
            else:
                del pending[seq]
            seq += 1
        if len(pending) > 2 * self.ops.maxlen:  # nobody polls (a test, a benchmark)
            oldest = self._seq - self.ops.maxlen
            self._drop(lambda seq, _: seq < oldest)

    def poll(self) -> None:
        """Ask every pending operation whether it is done, and let go of the done ones (and
        of those that left the ring). Any thread."""
        oldest = self._seq - self.ops.maxlen
        self._drop(lambda seq, done: seq < oldest or _done(done))

    def activity(self) -> tuple[int, int]:
        """(operations issued, operations not seen done): unchanged while the rank is stuck
        (``term_grace.py``); read after ``poll``. Any thread."""
        return self._seq, len(self._pending)

    def _drop(self, drop: Callable[[int, Callable[[], bool]], bool]) -> None:
        for seq, done in list(self._pending.items()):  # a copy: the main thread adds more
            if drop(seq, done):
                self._pending.pop(seq, None)

    # -- pipeline engine observer -----------------------------------------------------------
    def begin(self, program: list[Instruction]) -> None:
        self._program_count += 1
        self._program, self._pos = program, 0

    def after(self, step: object) -> None:
        pos = self._pos
        if pos is not None and pos < len(self._program) and step is self._program[pos]:
            self._pos = pos + 1

    def end(self) -> None:
        self._pos = None

    # -- dumps ------------------------------------------------------------------------------
    def snapshot(self) -> list[dict[str, Any]]:
        """The buffer as JSON-ready dicts, oldest first, each saying whether it completed;
        polls first (safe to call from another thread)."""
        self.poll()
        ops = list(self.ops)
        pending = set(self._pending)
        return [_as_dict(op, op.seq not in pending) for op in ops]


def describe_instruction(instruction: Instruction | None) -> str:
    """Compact schedule notation: F3 / B3 / X(send F3, recv B1), with ``@c`` for a model
    chunk c > 0 under interleaving (F3@1); '-' outside a program."""
    if isinstance(instruction, Forward | Backward):
        kind = "F" if isinstance(instruction, Forward) else "B"
        return kind + _work(instruction.micro_batch, instruction.chunk)
    if isinstance(instruction, Exchange):
        parts = [f"{name.split('_')[0]} {'F' if name.endswith('forward') else 'B'}"
                 f"{_work(mb, chunk)}" for name, mb, chunk in instruction.transfers()]
        return "X(" + ", ".join(parts) + ")"
    return "-"


def _unposted() -> bool:
    """An operation whose call has not returned (or raised) is not done."""
    return False


def _done(done: Callable[[], bool]) -> bool:
    """Whether a pending operation finished; a failed one (the query raises) did not."""
    try:
        return bool(done())
    except RuntimeError:
        return False


def _work(mb: int, chunk: int) -> str:
    return f"{mb}@{chunk}" if chunk else str(mb)


def _as_dict(op: Op, completed: bool) -> dict[str, Any]:
    return {"seq": op.seq, "time": op.time, "kind": op.kind, "group": op.group,
            "ranks": list(op.ranks), "group_seq": op.group_seq, "peer": op.peer,
            "shape": list(op.shape), "dtype": str(op.dtype).removeprefix("torch."),
            "iteration": op.iteration, "program": op.program, "step": op.step,
            "instruction": describe_instruction(op.instruction), "completed": completed,
            "tag": None if op.tag is None else list(op.tag) if isinstance(op.tag, tuple)
            else str(op.tag)}
