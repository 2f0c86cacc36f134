"""The vocabulary of pipeline schedules: what one stage does, step by step.

A schedule is a pure list of these per stage (``schedule.py`` makes them, tests inspect and
simulate them without processes, ``engine.py`` executes them). Communication with the
neighbouring stages is one ``Exchange`` step whose sends and receives are posted together and
then all awaited, so two neighbours sending to each other at once cannot deadlock, and every
message between two stages travels in one fixed order.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Forward:
    """Run this stage's layers on micro-batch ``micro_batch`` (its input must be here)."""

    micro_batch: int


@dataclass(frozen=True)
class Backward:
    """Backpropagate micro-batch ``micro_batch`` through this stage (the output's gradient
    must be here: received, or the loss on the last stage)."""

    micro_batch: int


@dataclass(frozen=True)
class Exchange:
    """Post every listed transfer with the neighbours, then wait for all of them.

    send_forward: send this stage's output of that micro-batch to the next stage.
    recv_forward: receive that micro-batch's input from the previous stage.
    send_backward: send the gradient of that micro-batch's input to the previous stage.
    recv_backward: receive the gradient of that micro-batch's output from the next stage.
    """

    send_forward: int | None = None
    recv_forward: int | None = None
    send_backward: int | None = None
    recv_backward: int | None = None


Instruction = Forward | Backward | Exchange
