"""The ZeRO-3 fetch plan: every gather, wait, release and gradient reduction of one pipeline
program, computed once before the program first runs and then replayed.

The pipeline program (``pipeline/schedule.py``) fixes the order of every micro-batch's forward
and backward on this stage, and a stage (or, under interleaving, each of its chunks) runs its
layers in order, so the sequence of layer computations is known in advance. From it this
module derives, as plain data, what to do at each *point* of the run: before and after each
layer's forward, before each layer's backward, after each micro-batch's backward, and at the
end of the program. The runtime (``runtime.py``) only executes the ops of the next point when
a hook fires.

Rules:
- A unit is gathered when a layer needs it and it is not resident. Pooled units share
  ``slots`` buffers (unit k of the pool in slot k mod slots); a pooled unit is released after a
  computation unless the very next computation needs it too. Pinned units (tied weights, and
  every unit when ``reshard_after_forward`` is False) have a buffer of their own and stay
  gathered until the end of the program.
- With prefetch depth d, the gather needed by computation i is issued at the point before
  computation i - d, but never before its slot is free nor before the previous gather (all
  ranks issue collectives in one order). Its wait is at the point before computation i.
- In a backward, a unit's gradient buffer is zeroed before the first layer using it, and its
  gradients are reduce-scattered once after the last layer using it: once per backward
  instruction, or, for the units that *accumulate* (every unit when ``reshard_after_forward``
  is False: each stays in a buffer of its own), once per program: zeroed before their first
  backward, they sum every micro-batch's gradients and are reduce-scattered after their last
  backward, while the rest of that backward still runs.
Within a point the ops run as: releases and reductions, gathers, gradient zeroing, waits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron3d.pipeline.instructions import Backward, Forward

GATHER, WAIT, RELEASE, GRADS, REDUCE = "gather", "wait", "release", "grads", "reduce"
_ORDER = {RELEASE: 0, REDUCE: 0, GATHER: 1, GRADS: 2, WAIT: 3}


@dataclass(frozen=True)
class Op:
    kind: str
    unit: int


@dataclass
class Point:
    """trigger: ("begin",), ("pre", layer, backward), ("post", layer), ("tail",), ("end",)."""

    trigger: tuple
    ops: list[Op] = field(default_factory=list)


@dataclass(frozen=True)
class Plan:
    """passes[u]: the backward passes (instructions) whose gradients each of unit u's
    reductions sums: 1, or every pass using u when it accumulates over the program."""

    points: tuple[Point, ...]
    passes: dict[int, int]

    def count(self, kind: str) -> int:
        return sum(op.kind == kind for p in self.points for op in p.ops)


@dataclass(frozen=True)
class _Compute:
    backward: bool
    layer: int
    pre: int  # index of the point before it
    after: int  # index of the point where what it used may be released


def build_plan(program: list, needs: tuple[tuple[int, ...], ...], slot_of: dict[int, int],
               pinned: frozenset[int], depth: int, chunk_sizes: tuple[int, ...] = (),
               accumulate: frozenset[int] = frozenset()) -> Plan:
    """``needs[j]``: units layer j uses; ``slot_of``: each unit's buffer; ``pinned``: units
    gathered once and kept until the end; ``chunk_sizes``: layers per model chunk, in order
    (interleaving; default one chunk of every layer); ``accumulate``: pinned units whose
    gradients are reduced once per program instead of once per backward."""
    assert accumulate <= pinned, "only a unit with a buffer of its own can accumulate"
    points, computes = _timeline(program, chunk_sizes or (len(needs),))
    demands = _residency(points, computes, needs, slot_of, pinned)
    issued = 0
    for step, unit, free_at in demands:
        desired = computes[step - depth].pre if step >= depth else 0
        issued = max(desired, issued, free_at)
        points[issued].ops.append(Op(GATHER, unit))
        points[computes[step].pre].ops.append(Op(WAIT, unit))
    passes = _gradients(points, computes, needs, accumulate)
    for p in points:
        p.ops.sort(key=lambda op: _ORDER[op.kind])  # stable: keeps issue order within a kind
    return Plan(tuple(points), passes)


def _timeline(program: list,
              chunk_sizes: tuple[int, ...]) -> tuple[list[Point], list[_Compute]]:
    points, computes = [Point(("begin",))], []
    starts = [sum(chunk_sizes[:c]) for c in range(len(chunk_sizes))]
    for instruction in program:
        if not isinstance(instruction, Forward | Backward):
            continue
        layers = range(starts[instruction.chunk],
                       starts[instruction.chunk] + chunk_sizes[instruction.chunk])
        if isinstance(instruction, Forward):
            for j in layers:
                points += [Point(("pre", j, False)), Point(("post", j))]
                computes.append(_Compute(False, j, len(points) - 2, len(points) - 1))
        else:
            for j in reversed(layers):
                points.append(Point(("pre", j, True)))
                computes.append(_Compute(True, j, len(points) - 1, len(points)))
            points.append(Point(("tail",)))
    points.append(Point(("end",)))
    return points, computes


def _residency(points: list[Point], computes: list[_Compute], needs, slot_of: dict[int, int],
               pinned: frozenset[int]) -> list[tuple[int, int, int]]:
    """Place releases; return the gathers needed as (computation, unit, point where its slot
    became free)."""
    resident: set[int] = set()
    free_at: dict[int, int] = {}  # slot -> point index of its last release
    demands = []
    for i, c in enumerate(computes):
        for unit in needs[c.layer]:
            if unit not in resident:
                resident.add(unit)
                demands.append((i, unit, free_at.get(slot_of[unit], 0)))
        following = set(needs[computes[i + 1].layer]) if i + 1 < len(computes) else set()
        for unit in needs[c.layer]:
            if unit not in pinned and unit not in following:
                resident.discard(unit)
                points[c.after].ops.append(Op(RELEASE, unit))
                free_at[slot_of[unit]] = c.after
    for unit in sorted(resident):
        points[-1].ops.append(Op(RELEASE, unit))
    return demands


def _gradients(points: list[Point], computes: list[_Compute], needs,
               accumulate: frozenset[int]) -> dict[int, int]:
    """Zero each unit's gradient buffer before its first backward use and reduce-scatter it
    after its last: per backward instruction, or over the whole program for the units in
    ``accumulate``. Return the passes each reduction sums."""
    first: dict[int, int] = {}  # unit -> its first backward computation since its zeroing
    last: dict[int, int] = {}
    passes: dict[int, int] = {}
    used: set[int] = set()  # units of the backward instruction running

    def place(units: list[int]) -> None:
        for unit in units:
            points[computes[first.pop(unit)].pre].ops.append(Op(GRADS, unit))
        for unit in units:
            points[computes[last.pop(unit)].after].ops.append(Op(REDUCE, unit))

    for i, c in enumerate(computes):
        if not c.backward:
            continue
        for unit in needs[c.layer]:
            first.setdefault(unit, i)
            last[unit] = i
            used.add(unit)
        if points[c.after].trigger == ("tail",):  # the backward instruction ends here
            for unit in used:
                passes[unit] = passes.get(unit, 0) + 1 if unit in accumulate else 1
            used = set()
            place([unit for unit in first if unit not in accumulate])
    place(list(first))
    return passes
