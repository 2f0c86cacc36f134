"""The vocabulary of pipeline schedules: what one pipeline rank does, step by step.

A schedule is a pure list of these per rank (``schedule.py`` makes them, tests inspect and
simulate them without processes, ``engine.py`` executes them). Communication with the
neighbouring ranks is one ``Exchange`` step whose sends and receives are posted together, so
two neighbours sending to each other at once cannot deadlock (``mpu/comm.py`` says how on
each backend), and every message between two ranks travels in one fixed order. Schedules
are checked as if an exchange then waited for all its transfers; the engine waits for each
only where it is needed, which is never earlier.

With interleaving a rank holds ``v`` model chunks: chunk ``c`` of rank ``r`` is virtual stage
``c * p + r`` of ``p * v``. Computations and transfers name the chunk they belong to on the
rank that lists them (0 without interleaving), so the last rank's chunk ``c`` sends its output
to the first rank's chunk ``c + 1``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Forward:
    """Run chunk ``chunk``'s layers on micro-batch ``micro_batch`` (its input must be here)."""

    micro_batch: int
    chunk: int = 0


@dataclass(frozen=True)
class Backward:
    """Backpropagate micro-batch ``micro_batch`` through chunk ``chunk`` (the output's
    gradient must be here: received, or the loss on the last virtual stage)."""

    micro_batch: int
    chunk: int = 0


@dataclass(frozen=True)
class Exchange:
    """Post every listed transfer with the neighbours (each is complete before what needs it).

    send_forward: send this stage's output of that micro-batch to the next stage.
    recv_forward: receive that micro-batch's input from the previous stage.
    send_backward: send the gradient of that micro-batch's input to the previous stage.
    recv_backward: receive the gradient of that micro-batch's output from the next stage.
    """

    send_forward: int | None = None
    recv_forward: int | None = None
    send_backward: int | None = None
    recv_backward: int | None = None
    # The chunk each transfer belongs to on this rank (interleaving; 0 otherwise), in the
    # order of the fields above.
    chunks: tuple[int, int, int, int] = (0, 0, 0, 0)

    def transfers(self) -> list[tuple[str, int, int]]:
        """(field, micro-batch, chunk) of each listed transfer, in field order."""
        return [(name, mb, chunk) for name, mb, chunk in zip(
            TRANSFERS, (self.send_forward, self.recv_forward, self.send_backward,
                        self.recv_backward), self.chunks, strict=True) if mb is not None]


TRANSFERS = ("send_forward", "recv_forward", "send_backward", "recv_backward")


Instruction = Forward | Backward | Exchange
