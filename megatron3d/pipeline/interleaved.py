"""Interleaved 1F1B (Narayanan et al. 2021, Megatron's virtual pipeline): each of the ``p``
ranks holds ``v`` model chunks, chunk ``c`` of rank ``r`` being virtual stage ``c * p + r``, so
a micro-batch crosses the ring of ranks ``v`` times and the bubble shrinks to
``(p - 1) / (v * m)`` of the ideal time.

Order of work on every rank: micro-batches in groups of ``p``; within a group, every chunk in
turn (forward: chunk 0 first; backward: the last chunk first). Rank ``r`` runs
``2 * (p - r - 1) + (v - 1) * p`` forwards before its first backward (all of them when
``m == p``), then alternates one forward and one backward, then drains the backwards. Every
computation is followed by one ``Exchange`` with the neighbours (one for the pair in the
steady state), as in Megatron, so all ranks post their transfers in the same lock-step.

Which message a receive gets is fixed by the order in which the peer sends, so the schedule
is made in two passes: every rank's computations and sends, with receives left open; then
each rank's receives from a peer are paired, first to first, with that peer's sends to it,
which names them (micro-batch and chunk). ``simulate.py`` checks the result.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from megatron3d.config import ParallelConfig
from megatron3d.errors import ConfigError
from megatron3d.pipeline.instructions import Backward, Exchange, Forward, Instruction

Work = tuple[int, int]  # (micro-batch, chunk)
_SIZE_FLAG = "--virtual-pipeline-model-parallel-size"
_PER_FLAG = "--num-layers-per-virtual-pipeline-stage"


@dataclass
class _Open:
    """An Exchange being made: sends known, receives only flagged until they are named."""

    send_forward: Work | None = None
    send_backward: Work | None = None
    recv_forward: bool = False
    recv_backward: bool = False
    named: dict[str, Work] = field(default_factory=dict)


@dataclass(frozen=True)
class _Order:
    """Which computation is the k-th of a rank (the same on every rank)."""

    ranks: int
    chunks: int

    def work(self, k: int, forward: bool) -> Work:
        group, offset = divmod(k, self.ranks * self.chunks)
        chunk = offset // self.ranks
        return (group * self.ranks + offset % self.ranks,
                chunk if forward else self.chunks - 1 - chunk)


def check_interleaving(parallel: ParallelConfig, num_layers: int,
                       micro_batches: list[int]) -> None:
    """``ConfigError`` (one line) unless the interleaved schedule can run this layout:
    ``micro_batches`` are the counts per step over the whole batch-size ramp."""
    conflicts = interleaving_conflicts(parallel, num_layers, micro_batches)
    if conflicts:
        raise ConfigError(conflicts[0])


def interleaving_conflicts(parallel: ParallelConfig, num_layers: int,
                           micro_batches: list[int] | None) -> list[str]:
    """Every reason the interleaved schedule cannot run this layout, one line each, naming
    the chunk flag the user gave; ``micro_batches`` None when the batch sizes do not fit the
    layout either (that check is then left out)."""
    per, given = (parallel.num_layers_per_virtual_pipeline_stage,
                  parallel.virtual_pipeline_model_parallel_size)
    p = parallel.pipeline_model_parallel_size
    if per is not None and given is not None:
        return [f"{_PER_FLAG}={per} and {_SIZE_FLAG}={given} both set the chunks per "
                "pipeline rank: give one of them"]
    if per is not None and num_layers % (p * per):
        return [f"{_PER_FLAG}={per} needs --num-layers {num_layers} to be a multiple of "
                f"PP x {per} = {p * per}: change one of them"]
    v = parallel.virtual_size(num_layers)
    if v <= 1:
        return []
    chunks = f"{_PER_FLAG}={per}" if per is not None else f"{_SIZE_FLAG}={v}"
    conflicts = []
    if p < 2:
        conflicts.append(f"interleaving ({chunks}) needs pipeline parallelism "
                         f"(--pipeline-model-parallel-size={p}): use PP >= 2 or drop it")
    if parallel.pipeline_schedule != "1f1b":
        conflicts.append(f"interleaving ({chunks}) is a 1F1B schedule "
                         f"(--pipeline-schedule={parallel.pipeline_schedule}): use 1f1b")
    bad = sorted({m for m in micro_batches or () if m % p})
    if bad:
        conflicts.append(f"the interleaved schedule needs micro-batches per step in multiples "
                         f"of PP = {p}, got {', '.join(map(str, bad))} ({chunks}): change "
                         "--global-batch-size (and the ramp) or --micro-batch-size")
    return conflicts


def interleaved_1f1b(num_stages: int, stage: int, num_micro_batches: int,
                     chunks: int) -> list[Instruction]:
    """Rank ``stage``'s interleaved program (``num_micro_batches`` a multiple of
    ``num_stages``; validated at start)."""
    return list(_programs(num_stages, num_micro_batches, chunks, False)[stage])


def interleaved_forward_only(num_stages: int, stage: int, num_micro_batches: int,
                             chunks: int) -> list[Instruction]:
    """Evaluation through the interleaved chunks: every forward, in the same order."""
    return list(_programs(num_stages, num_micro_batches, chunks, True)[stage])


@functools.cache
def _programs(p: int, m: int, v: int, forward_only: bool) -> tuple[tuple[Instruction, ...], ...]:
    skeletons = [_skeleton(p, r, m, v, forward_only) for r in range(p)]
    _name_receives(skeletons, p)
    return tuple(tuple(x for x in map(_close, program) if x != Exchange())
                 for program in skeletons)


def _skeleton(p: int, r: int, m: int, v: int,
              forward_only: bool) -> list[Forward | Backward | _Open]:
    order, total = _Order(p, v), m * v
    all_warmup = forward_only or m == p
    warmup = total if all_warmup else min(2 * (p - r - 1) + (v - 1) * p, total)
    steady = total - warmup

    def fwd(k: int) -> Forward:
        return Forward(*order.work(k, True))

    def bwd(k: int) -> Backward:
        return Backward(*order.work(k, False))

    def output(f: Forward) -> Work | None:  # the last virtual stage keeps its loss
        return None if (r == p - 1 and f.chunk == v - 1) else (f.micro_batch, f.chunk)

    def input_grad(b: Backward) -> Work | None:  # the first virtual stage has no input
        return None if (r == 0 and b.chunk == 0) else (b.micro_batch, b.chunk)

    program: list[Forward | Backward | _Open] = [_Open(recv_forward=r != 0)]
    for k in range(warmup):
        f = fwd(k)
        last_warmup = k == warmup - 1 and not all_warmup
        program += [f, _Open(
            send_forward=output(f),
            recv_forward=k < total - 1 and not (r == 0 and order.work(k + 1, True)[1] == 0),
            recv_backward=last_warmup and not (r == p - 1 and order.work(0, False)[1] == v - 1))]
    for k in range(steady):
        f, b = fwd(k + warmup), bwd(k)
        # The first rank runs p - 1 computations ahead of the last, so what arrives now is
        # the last rank's work of p - 1 steps earlier; nothing comes from the last chunk.
        ahead = order.work(k + warmup - (p - 1), True)[1] if r == 0 else None
        behind = order.work(k - (p - 1), False)[1] if r == p - 1 else None
        program += [f, b, _Open(
            send_forward=output(f), send_backward=input_grad(b),
            recv_forward=k < steady - 1 and ahead != v - 1,
            recv_backward=behind != 0)]
    if all_warmup and not forward_only:
        program.append(_Open(recv_backward=not (r == p - 1 and order.work(0, False)[1] == v - 1)))
    for k in range(0 if forward_only else steady, 0 if forward_only else total):
        b = bwd(k)
        program += [b, _Open(
            send_backward=input_grad(b),
            recv_backward=k < total - 1 and not (r == p - 1
                                                and order.work(k + 1, False)[1] == v - 1))]
    return program


def _name_receives(programs: list[list], p: int) -> None:
    """Pair each receive with its peer's send, first to first per (sender, receiver)."""
    sent = _sent_messages(programs, p)
    taken: dict[tuple[int, int], int] = {}
    for r, program in enumerate(programs):
        for step in (s for s in program if isinstance(s, _Open)):
            for field_name, wanted, src in (("recv_forward", "F", (r - 1) % p),
                                            ("recv_backward", "B", (r + 1) % p)):
                if getattr(step, field_name):
                    index = taken.get((src, r), 0)
                    kind, work = sent[src, r][index]
                    assert kind == wanted, f"rank {r} would receive {kind} as {wanted}"
                    taken[src, r] = index + 1
                    step.named[field_name] = work


def _sent_messages(programs: list[list], p: int) -> dict[tuple[int, int], list]:
    """(sender, receiver) -> the messages in the order sent, each named as its receiver
    names it: the last rank's chunk c feeds the first rank's chunk c + 1, and back."""
    sent: dict[tuple[int, int], list[tuple[str, Work]]] = {}
    for r, program in enumerate(programs):
        for step in (s for s in program if isinstance(s, _Open)):
            if step.send_forward is not None:
                mb, chunk = step.send_forward
                sent.setdefault((r, (r + 1) % p), []).append(
                    ("F", (mb, chunk + (r == p - 1))))
            if step.send_backward is not None:
                mb, chunk = step.send_backward
                sent.setdefault((r, (r - 1) % p), []).append(("B", (mb, chunk - (r == 0))))
    return sent


def _close(step: Forward | Backward | _Open) -> Instruction:
    if not isinstance(step, _Open):
        return step
    works = (step.send_forward, step.named.get("recv_forward"), step.send_backward,
             step.named.get("recv_backward"))
    return Exchange(*(None if w is None else w[0] for w in works),
                    chunks=tuple(0 if w is None else w[1] for w in works))
