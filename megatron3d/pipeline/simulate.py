"""Run every stage's schedule together, without processes, to prove it finishes and is sound.

Why: a schedule bug on a real cluster is a silent hang or, worse, a gradient paired with the
wrong micro-batch. Executing the pure instruction lists with the engine's communication rules
catches both in microseconds, so tests run it on every layout and the engine can run it once
at start on the real schedule.

Rules (those of ``instructions.py`` and isend/irecv):

- An ``Exchange`` posts all its transfers, then waits until every one is matched. A posted
  transfer stays posted until matched, whatever its poster does meanwhile.
- Per link (stage ``s`` <-> ``s + 1``) and direction, the k-th send matches the k-th receive
  (FIFO); both must name the same micro-batch.
- ``Forward(mb)`` needs ``mb``'s input (received, or stage 0); ``Backward(mb)`` needs
  ``Forward(mb)`` done and the output gradient (received, or the last stage). Sending an
  output or a gradient needs the computation that makes it done.
- If no stage can move and some have not finished, the schedule deadlocks.

Time model: a forward costs ``forward_cost``, a backward ``backward_cost``, a transfer
nothing; a matched pair completes when the later side posted it. The makespan and the idle
time per stage give the pipeline bubble.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from megatron3d.pipeline.instructions import Backward, Exchange, Forward, Instruction

_TRANSFERS = ("send_forward", "recv_forward", "send_backward", "recv_backward")


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
    """One posted send or receive."""

    stage: int
    kind: str
    micro_batch: int
    posted_at: int
    done_at: int | None = None  # set when matched


@dataclass
class _Stage:
    program: list[Instruction]
    pc: int = 0
    clock: int = 0
    pending: list[_Transfer] | None = None  # the current Exchange's transfers once posted
    inputs: set[int] = field(default_factory=set)  # received, not yet consumed
    grads: set[int] = field(default_factory=set)
    forwards: set[int] = field(default_factory=set)
    backwards: set[int] = field(default_factory=set)
    events: list[Event] = field(default_factory=list)
    peak: int = 0
    busy: int = 0

    @property
    def finished(self) -> bool:
        return self.pc >= len(self.program)


def simulate(programs: list[list[Instruction]], forward_cost: int = 1,
             backward_cost: int = 2) -> SimulationReport:
    """Execute ``programs[s]`` on stage ``s`` for every stage; raise ``ScheduleError`` on a
    deadlock, a mis-paired transfer or a broken dependency."""
    sim = _Simulator(programs, forward_cost, backward_cost)
    sim.run()
    return sim.report()


class _Simulator:
    """The mutable state of one simulation; only ``simulate`` sees it."""

    def __init__(self, programs: list[list[Instruction]], forward_cost: int,
                 backward_cost: int) -> None:
        self.stages = [_Stage(list(program)) for program in programs]
        self.costs = {Forward: forward_cost, Backward: backward_cost}
        # (link, direction) -> unmatched sends, unmatched receives; link s joins s and s + 1.
        self.queues: dict[tuple[int, str], tuple[deque[_Transfer], deque[_Transfer]]] = {}

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

    def _step(self, s: int) -> bool:
        """Advance stage ``s`` by one instruction or by posting; False if it cannot move."""
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
            stage.pending = [self._post(s, kind, getattr(step, kind))
                             for kind in _TRANSFERS if getattr(step, kind) is not None]
            if not stage.pending:
                raise ScheduleError(f"stage {s} instruction {stage.pc} is an empty Exchange")
            return True
        if any(t.done_at is None for t in stage.pending):
            return False
        stage.clock = max([stage.clock] + [t.done_at or 0 for t in stage.pending])
        stage.pending = None
        stage.pc += 1
        return True

    def _post(self, s: int, kind: str, mb: int) -> _Transfer:
        """Queue one transfer on its link and match it with the oldest opposite one."""
        stage = self.stages[s]
        link, peer = {"send_forward": (s, s + 1), "recv_forward": (s - 1, s - 1),
                      "send_backward": (s - 1, s - 1), "recv_backward": (s, s + 1)}[kind]
        if not 0 <= peer < len(self.stages):
            raise ScheduleError(f"stage {s} posts {kind}({mb}) but has no stage {peer}")
        made = stage.forwards if kind == "send_forward" else stage.backwards
        if kind.startswith("send") and mb not in made:
            raise ScheduleError(f"stage {s} posts {kind}({mb}) before computing it")
        transfer = _Transfer(s, kind, mb, stage.clock)
        direction = kind.split("_")[1]
        sends, recvs = self.queues.setdefault((link, direction), (deque(), deque()))
        mine, theirs = (sends, recvs) if kind.startswith("send") else (recvs, sends)
        if theirs:
            self._match(transfer, theirs.popleft())
        else:
            mine.append(transfer)
        return transfer

    def _match(self, a: _Transfer, b: _Transfer) -> None:
        send, recv = (a, b) if a.kind.startswith("send") else (b, a)
        if send.micro_batch != recv.micro_batch:
            raise ScheduleError(
                f"mis-paired {send.kind}: stage {send.stage} sends micro-batch "
                f"{send.micro_batch} but stage {recv.stage} receives it as micro-batch "
                f"{recv.micro_batch}")
        send.done_at = recv.done_at = max(send.posted_at, recv.posted_at)
        receiver = self.stages[recv.stage]
        arrived = receiver.inputs if recv.kind == "recv_forward" else receiver.grads
        arrived.add(recv.micro_batch)

    def _waiting_for(self, s: int, instruction: Forward | Backward) -> str | None:
        """Why ``instruction`` cannot run yet on stage ``s`` (None: it can)."""
        stage = self.stages[s]
        mb = instruction.micro_batch
        done = stage.forwards if isinstance(instruction, Forward) else stage.backwards
        if mb in done:
            raise ScheduleError(f"stage {s} runs {instruction} twice")
        if isinstance(instruction, Forward):
            return None if s == 0 or mb in stage.inputs else "input not received"
        if mb not in stage.forwards:
            return "its Forward has not run"
        last = s == len(self.stages) - 1
        return None if last or mb in stage.grads else "output gradient not received"

    def _compute(self, stage: _Stage, instruction: Forward | Backward) -> None:
        mb = instruction.micro_batch
        cost = self.costs[type(instruction)]
        if isinstance(instruction, Forward):
            stage.forwards.add(mb)
            stage.inputs.discard(mb)
        else:
            stage.backwards.add(mb)
            stage.grads.discard(mb)
        stage.peak = max(stage.peak, len(stage.forwards) - len(stage.backwards))
        stage.events.append(Event(instruction, stage.clock, stage.clock + cost))
        stage.clock += cost
        stage.busy += cost
        stage.pc += 1

    def _blocked(self) -> list[str]:
        """Each unfinished stage's current instruction and what it waits for."""
        lines = []
        for s, stage in enumerate(self.stages):
            if stage.finished:
                continue
            instruction = stage.program[stage.pc]
            if isinstance(instruction, Exchange):
                reason = "unmatched " + ", ".join(
                    f"{t.kind}({t.micro_batch})" for t in stage.pending or []
                    if t.done_at is None)
            else:
                reason = self._waiting_for(s, instruction) or "ready"
            lines.append(f"stage {s} at instruction {stage.pc} {instruction}: {reason}")
        return lines
