"""Run every rank's schedule together, without processes, to prove it finishes and is sound.

Why: a schedule bug on a real cluster is a silent hang or, worse, a gradient paired with the
wrong micro-batch. Executing the pure instruction lists with the engine's communication rules
catches both in microseconds, so tests run it on every layout and the engine can run it once
at start on the real schedule.

Rules (the blocking model of ``instructions.py``; the engine, on gloo and on NCCL's streams,
only ever waits for a transfer this model has already matched: ``mpu/comm.py``):

- An ``Exchange`` posts all its transfers, then waits until every one is matched. A posted
  transfer stays posted until matched, whatever its poster does meanwhile.
- Between two ranks, in one direction, the k-th send matches the k-th receive (FIFO, whatever
  the message is: with two ranks and interleaving, activations and gradients share the
  pair); both must name the same message: activation or gradient, micro-batch and chunk.
- With ``chunks`` v > 1 the ranks form a ring: the last rank's chunk c sends to the first
  rank's chunk c + 1, and gradients go back the same way.
- ``Forward`` needs its input (received, or the first virtual stage); ``Backward`` needs its
  ``Forward`` done and the output gradient (received, or the last virtual stage). Sending an
  output or a gradient needs the computation that makes it done.
- If no rank can move and some have not finished, the schedule deadlocks.

Time model: a forward costs ``forward_cost``, a backward ``backward_cost``, a transfer
nothing; a matched pair completes when the later side posted it. The makespan and the idle
time per rank give the pipeline bubble.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from megatron3d.pipeline.instructions import Backward, Exchange, Forward, Instruction

Work = tuple[int, int]  # (micro-batch, chunk)


class ScheduleError(RuntimeError):
    """The schedules deadlock, mis-pair micro-batches or break a dependency (a bug, not bad
    input: schedules are generated, never written by users)."""


@dataclass(frozen=True)
class Event:
    """One computation a stage ran, and when."""

    instruction: Forward | Backward
    start: int
    end: int


@dataclass(frozen=True)
class StageReport:
    """What one stage did: computations in order, peak activations held, time busy/idle."""

    events: tuple[Event, ...]
    peak_activations: int  # max over time of forwards done minus backwards done
    busy_time: int
    idle_time: int  # makespan - busy_time: waiting on neighbours, the bubble

    @property
    def order(self) -> tuple[Forward | Backward, ...]:
        return tuple(event.instruction for event in self.events)


@dataclass(frozen=True)
class SimulationReport:
    stages: tuple[StageReport, ...]
    makespan: int  # time the last stage finishes

    @property
    def bubble_fraction(self) -> float:
        """Share of stage-time spent idle (0 with one stage)."""
        total = self.makespan * len(self.stages)
        return sum(s.idle_time for s in self.stages) / total if total else 0.0


@dataclass
class _Transfer:
    """One posted send or receive; ``message`` is what the receiving rank calls it."""

    stage: int
    kind: str
    work: Work  # on the rank that posted it
    message: tuple[str, Work]  # ("F" activation or "B" gradient, (micro-batch, chunk))
    posted_at: int
    done_at: int | None = None  # set when matched


@dataclass
class _Stage:
    program: list[Instruction]
    pc: int = 0
    clock: int = 0
    pending: list[_Transfer] | None = None  # the current Exchange's transfers once posted
    inputs: set[Work] = field(default_factory=set)  # received, not yet consumed
    grads: set[Work] = field(default_factory=set)
    forwards: set[Work] = field(default_factory=set)
    backwards: set[Work] = field(default_factory=set)
    events: list[Event] = field(default_factory=list)
    peak: int = 0
    busy: int = 0

    @property
    def finished(self) -> bool:
        return self.pc >= len(self.program)


def simulate(programs: list[list[Instruction]], chunks: int = 1, forward_cost: int = 1,
             backward_cost: int = 2) -> SimulationReport:
    """Execute ``programs[r]`` on rank ``r`` for every rank, each holding ``chunks`` model
    chunks; raise ``ScheduleError`` on a deadlock, a mis-paired transfer or a broken
    dependency."""
    sim = _Simulator(programs, chunks, forward_cost, backward_cost)
    sim.run()
    return sim.report()


def _show(kind: str, work: Work) -> str:
    mb, chunk = work
    return f"{kind}({mb})" if chunk == 0 else f"{kind}({mb}, chunk {chunk})"


class _Simulator:
    """The mutable state of one simulation; only ``simulate`` sees it."""

    def __init__(self, programs: list[list[Instruction]], chunks: int, forward_cost: int,
                 backward_cost: int) -> None:
        self.stages = [_Stage(list(program)) for program in programs]
        self.chunks = chunks
        self.costs = {Forward: forward_cost, Backward: backward_cost}
        # (sender, receiver) -> unmatched sends, unmatched receives, oldest first.
        self.queues: dict[tuple[int, int], tuple[deque[_Transfer], deque[_Transfer]]] = {}

    def run(self) -> None:
        while not all(stage.finished for stage in self.stages):
            moved = [self._step(s) for s in range(len(self.stages))]
            if not any(moved):
                raise ScheduleError("deadlock: " + "; ".join(self._blocked()))
        for s, stage in enumerate(self.stages):
            if stage.inputs or stage.grads:
                raise ScheduleError(f"stage {s} received inputs {sorted(stage.inputs)} and "
                                    f"gradients {sorted(stage.grads)} it never used")

    def report(self) -> SimulationReport:
        makespan = max((stage.clock for stage in self.stages), default=0)
        return SimulationReport(
            stages=tuple(StageReport(tuple(st.events), st.peak, st.busy, makespan - st.busy)
                         for st in self.stages),
            makespan=makespan,
        )

    def _first(self, s: int, chunk: int) -> bool:
        return s == 0 and chunk == 0

    def _last(self, s: int, chunk: int) -> bool:
        return s == len(self.stages) - 1 and chunk == self.chunks - 1

    def _step(self, s: int) -> bool:
        """Advance rank ``s`` by one instruction or by posting; False if it cannot move."""
        stage = self.stages[s]
        if stage.finished:
            return False
        instruction = stage.program[stage.pc]
        if isinstance(instruction, Exchange):
            return self._exchange(s, instruction)
        if self._waiting_for(s, instruction):
            return False
        self._compute(stage, instruction)
        return True

    def _exchange(self, s: int, step: Exchange) -> bool:
        stage = self.stages[s]
        if stage.pending is None:
            stage.pending = [self._post(s, kind, (mb, chunk))
                             for kind, mb, chunk in step.transfers()]
            if not stage.pending:
                raise ScheduleError(f"stage {s} instruction {stage.pc} is an empty Exchange")
            return True
        if any(t.done_at is None for t in stage.pending):
            return False
        stage.clock = max([stage.clock] + [t.done_at or 0 for t in stage.pending])
        stage.pending = None
        stage.pc += 1
        return True

    def _route(self, s: int, kind: str, work: Work) -> tuple[int, tuple[str, Work]]:
        """The peer of a transfer and the message as the receiving rank names it."""
        mb, chunk = work
        last = len(self.stages) - 1
        forward = kind in ("send_forward", "recv_forward")
        ahead = kind in ("send_forward", "recv_backward")  # towards the next virtual stage
        step = 1 if ahead else -1
        peer, across = s + step, 0
        if not 0 <= peer <= last:
            crossing = (chunk < self.chunks - 1) if ahead else chunk > 0
            if not crossing or last == 0:
                raise ScheduleError(f"stage {s} posts {_show(kind, work)} but has no stage "
                                    f"{peer}")
            peer, across = peer % (last + 1), step  # around the ring, into the next chunk
        sending = kind.startswith("send")
        named = (mb, chunk + across) if sending else work
        return peer, ("F" if forward else "B", named)

    def _post(self, s: int, kind: str, work: Work) -> _Transfer:
        """Queue one transfer between its two ranks and match it with the oldest opposite
        one."""
        stage = self.stages[s]
        peer, message = self._route(s, kind, work)
        sending = kind.startswith("send")
        made = stage.forwards if kind == "send_forward" else stage.backwards
        if sending and work not in made:
            raise ScheduleError(f"stage {s} posts {_show(kind, work)} before computing it")
        transfer = _Transfer(s, kind, work, message, stage.clock)
        sends, recvs = self.queues.setdefault((s, peer) if sending else (peer, s),
                                              (deque(), deque()))
        mine, theirs = (sends, recvs) if sending else (recvs, sends)
        if theirs:
            self._match(transfer, theirs.popleft())
        else:
            mine.append(transfer)
        return transfer

    def _match(self, a: _Transfer, b: _Transfer) -> None:
        send, recv = (a, b) if a.kind.startswith("send") else (b, a)
        if send.message[0] != recv.message[0]:
            raise ScheduleError(f"mis-paired {send.kind}: stage {send.stage} sends "
                                f"{_show(send.kind, send.work)} but stage {recv.stage} "
                                f"receives it as {_show(recv.kind, recv.work)}")
        if send.message != recv.message:
            (_, (mb, chunk)), (_, (other, other_chunk)) = send.message, recv.message
            where = "" if chunk == other_chunk else f" of chunk {chunk}"
            there = "" if chunk == other_chunk else f" of chunk {other_chunk}"
            raise ScheduleError(
                f"mis-paired {send.kind}: stage {send.stage} sends micro-batch {mb}{where} but "
                f"stage {recv.stage} receives it as micro-batch {other}{there}")
        send.done_at = recv.done_at = max(send.posted_at, recv.posted_at)
        receiver = self.stages[recv.stage]
        arrived = receiver.inputs if recv.kind == "recv_forward" else receiver.grads
        arrived.add(recv.work)

    def _waiting_for(self, s: int, instruction: Forward | Backward) -> str | None:
        """Why ``instruction`` cannot run yet on rank ``s`` (None: it can)."""
        stage = self.stages[s]
        work = (instruction.micro_batch, instruction.chunk)
        done = stage.forwards if isinstance(instruction, Forward) else stage.backwards
        if work in done:
            raise ScheduleError(f"stage {s} runs {instruction} twice")
        if isinstance(instruction, Forward):
            first = self._first(s, instruction.chunk)
            return None if first or work in stage.inputs else "input not received"
        if work not in stage.forwards:
            return "its Forward has not run"
        last = self._last(s, instruction.chunk)
        return None if last or work in stage.grads else "output gradient not received"

    def _compute(self, stage: _Stage, instruction: Forward | Backward) -> None:
        work = (instruction.micro_batch, instruction.chunk)
        cost = self.costs[type(instruction)]
        if isinstance(instruction, Forward):
            stage.forwards.add(work)
            stage.inputs.discard(work)
        else:
            stage.backwards.add(work)
            stage.grads.discard(work)
        stage.peak = max(stage.peak, len(stage.forwards) - len(stage.backwards))
        stage.events.append(Event(instruction, stage.clock, stage.clock + cost))
        stage.clock += cost
        stage.busy += cost
        stage.pc += 1

    def _blocked(self) -> list[str]:
        """Each unfinished rank's current instruction and what it waits for."""
        lines = []
        for s, stage in enumerate(self.stages):
            if stage.finished:
                continue
            instruction = stage.program[stage.pc]
            if isinstance(instruction, Exchange):
                reason = "unmatched " + ", ".join(
                    _show(t.kind, t.work) for t in stage.pending or [] if t.done_at is None)
            else:
                reason = self._waiting_for(s, instruction) or "ready"
            lines.append(f"stage {s} at instruction {stage.pc} {instruction}: {reason}")
        return lines
