"""Pipeline schedules as pure per-stage instruction lists (see ``instructions.py``).

A schedule is data, not code that talks to other ranks: the same list is simulated in tests
(``simulate.py``) and interpreted by the engine, so its correctness is checked without
processes. Micro-batches run in order ``0..m-1`` in both directions; the first stage never
receives activations or sends gradients, the last never sends activations or receives
gradients, and no ``Exchange`` is empty.

- ``one_f_one_b`` (PipeDream-Flush, Megatron's default): after a short warm-up every forward
  is followed by a backward, so a stage holds at most ``num_stages - stage`` micro-batches'
  activations whatever the number of micro-batches.
- ``gpipe``: all forwards, then all backwards; holds all ``m`` micro-batches' activations.
  Same bubble as 1F1B, kept as the simple reference.
- ``forward_only``: evaluation, no backward.
"""

from __future__ import annotations

from collections.abc import Callable

from megatron3d.errors import ConfigError
from megatron3d.pipeline.instructions import Backward, Exchange, Forward, Instruction

Schedule = Callable[[int, int, int], list[Instruction]]


def one_f_one_b(num_stages: int, stage: int, num_micro_batches: int) -> list[Instruction]:
    """1F1B for one stage: warm-up forwards, steady one-forward-one-backward, cool-down.

    In the steady state the send of a forward output is posted with the receive of the
    gradient the next backward needs, and the send of an input gradient with the receive of
    the next forward's input, so neighbours exchange in both directions in one step.
    """
    _check(num_stages, stage, num_micro_batches)
    link = _Links(num_stages, stage)
    warmup = min(num_stages - stage - 1, num_micro_batches)
    steady = num_micro_batches - warmup
    program: list[Instruction] = []
    for mb in range(warmup):
        program += link.exchange(recv_forward=mb) + [Forward(mb)]
        program += link.exchange(send_forward=mb)
    if steady:
        program += link.exchange(recv_forward=warmup)
    for i in range(steady):
        forward_mb = warmup + i
        next_input = forward_mb + 1 if i + 1 < steady else None
        program += [Forward(forward_mb)]
        program += link.exchange(send_forward=forward_mb, recv_backward=i)
        program += [Backward(i)]
        program += link.exchange(send_backward=i, recv_forward=next_input)
    for mb in range(steady, num_micro_batches):
        program += link.exchange(recv_backward=mb) + [Backward(mb)]
        program += link.exchange(send_backward=mb)
    return program


def gpipe(num_stages: int, stage: int, num_micro_batches: int) -> list[Instruction]:
    """GPipe for one stage: every forward, then every backward (activations of all ``m``
    micro-batches alive at the peak)."""
    program = forward_only(num_stages, stage, num_micro_batches)
    link = _Links(num_stages, stage)
    for mb in range(num_micro_batches):
        program += link.exchange(recv_backward=mb) + [Backward(mb)]
        program += link.exchange(send_backward=mb)
    return program


def forward_only(num_stages: int, stage: int, num_micro_batches: int) -> list[Instruction]:
    """Evaluation: receive, forward, send for each micro-batch in order; no backward."""
    _check(num_stages, stage, num_micro_batches)
    link = _Links(num_stages, stage)
    program: list[Instruction] = []
    for mb in range(num_micro_batches):
        program += link.exchange(recv_forward=mb) + [Forward(mb)]
        program += link.exchange(send_forward=mb)
    return program


SCHEDULES: dict[str, Schedule] = {"1f1b": one_f_one_b, "gpipe": gpipe}


def schedule_for(name: str, num_stages: int, stage: int,
                 num_micro_batches: int) -> list[Instruction]:
    """The training schedule called ``name`` ("1f1b" or "gpipe") for one stage."""
    if name not in SCHEDULES:
        raise ConfigError(f"unknown pipeline schedule ({name!r}): use one of "
                          f"{', '.join(SCHEDULES)}")
    return SCHEDULES[name](num_stages, stage, num_micro_batches)


class _Links:
    """Which neighbours a stage has: drops the transfers the first or last stage lacks."""

    def __init__(self, num_stages: int, stage: int) -> None:
        self.has_prev = stage > 0
        self.has_next = stage < num_stages - 1

    def exchange(self, *, send_forward: int | None = None, recv_forward: int | None = None,
                 send_backward: int | None = None,
                 recv_backward: int | None = None) -> list[Instruction]:
        """``[Exchange(...)]`` of the transfers this stage really has, or ``[]`` if none."""
        step = Exchange(
            send_forward=send_forward if self.has_next else None,
            recv_forward=recv_forward if self.has_prev else None,
            send_backward=send_backward if self.has_prev else None,
            recv_backward=recv_backward if self.has_next else None,
        )
        return [] if step == Exchange() else [step]


def _check(num_stages: int, stage: int, num_micro_batches: int) -> None:
    """Reject a layout no schedule can serve, before any instruction is made."""
    if num_stages < 1:
        raise ConfigError(f"the pipeline needs at least one stage "
                          f"(--pipeline-model-parallel-size={num_stages}): use a size >= 1")
    if not 0 <= stage < num_stages:
        raise ConfigError(f"pipeline stage {stage} is outside 0..{num_stages - 1} "
                          f"(--pipeline-model-parallel-size={num_stages}): pass this rank's "
                          "pipeline rank")
    if num_micro_batches < 1:
        raise ConfigError(f"a pipeline step needs at least one micro-batch "
                          f"(num_micro_batches={num_micro_batches}): raise "
                          "--global-batch-size or lower --micro-batch-size")
