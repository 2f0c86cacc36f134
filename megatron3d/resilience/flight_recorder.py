"""The communication flight recorder: the last N operations this rank issued, for hang dumps.

It is attached twice: as a ``traffic`` observer it sees every collective and point-to-point
operation ``mpu/comm.py`` issues, and as a pipeline-engine observer it knows which schedule
instruction (and so which micro-batch) is running. Recording appends one tuple to a bounded
deque and touches no tensor data (shape and dtype are metadata), so it costs about a
microsecond per operation and never syncs with the device; everything is formatted only
when a dump is written.

Sequence numbers are what make dumps of different ranks comparable: collectives are numbered
per process group (every member issues the same sequence), sends and receives per (group,
direction, peer), so rank a's k-th send to b is the message b's k-th receive from a waits for.
"""

from __future__ import annotations

import collections
import time
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
    peer: int | None  # global rank of the other side of a send or receive
    shape: tuple[int, ...]
    dtype: torch.dtype
    iteration: int  # the training step in progress (0 before the first)
    program: int  # engine programs begun so far (training and evaluation batches)
    step: int | None  # index of the running instruction in that program, None outside
    instruction: Instruction | None
    tag: Any  # what the caller said it serves: ("unit", 3), ("bucket", 0), ("F", 2) ...


class FlightRecorder:
    """Ring buffer of ``Op``; call it as a traffic observer, give it to the engine too."""

    def __init__(self, size: int) -> None:
        self.ops: collections.deque[Op] = collections.deque(maxlen=max(size, 1))
        self.iteration = 0  # set by whoever drives the steps (the watchdog's heartbeat)
        self._seq = 0
        self._counts: dict[tuple, int] = {}
        self._program_count = 0
        self._program: list[Instruction] = []
        self._pos: int | None = None

    # -- traffic observer -------------------------------------------------------------------
    def __call__(self, kind: str, tensor: torch.Tensor, axis: AxisGroup,
                 peer: int | None = None, tag: Any = None) -> None:
        key = (id(axis.group), kind, peer) if peer is not None else id(axis.group)
        group_seq = self._counts.get(key, 0)
        self._counts[key] = group_seq + 1
        pos = self._pos
        instruction = self._program[pos] if pos is not None and pos < len(self._program) else None
        self.ops.append(Op(self._seq, time.time(), kind, axis.name, axis.ranks, group_seq, peer,
                           tuple(tensor.shape), tensor.dtype, self.iteration,
                           self._program_count, pos, instruction, tag))
        self._seq += 1

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
        """The buffer as JSON-ready dicts, oldest first (safe to call from another thread)."""
        return [_as_dict(op) for op in list(self.ops)]


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


def _work(mb: int, chunk: int) -> str:
    return f"{mb}@{chunk}" if chunk else str(mb)


def _as_dict(op: Op) -> dict[str, Any]:
    return {"seq": op.seq, "time": op.time, "kind": op.kind, "group": op.group,
            "ranks": list(op.ranks), "group_seq": op.group_seq, "peer": op.peer,
            "shape": list(op.shape), "dtype": str(op.dtype).removeprefix("torch."),
            "iteration": op.iteration, "program": op.program, "step": op.step,
            "instruction": describe_instruction(op.instruction),
            "tag": None if op.tag is None else list(op.tag) if isinstance(op.tag, tuple)
            else str(op.tag)}
