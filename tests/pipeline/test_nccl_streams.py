"""The engine's transfers, posted as ``comm.start_exchange`` posts them on NCCL, finish for
every schedule the simulator accepts (1F1B, GPipe, evaluation, interleaved; PP 2..8).

A model of NCCL, not processes. Each rank walks its program as ``engine.py`` does: it posts
an exchange's transfers one by one in comm's order (link order), each on a CUDA stream; it
waits for a received tensor just before the computation that reads it, and for an
exchange's sends after posting the next exchange (or at the end); the host never blocks, as
waits on NCCL only order the compute stream. A stream runs its transfers in the order
posted, and a send completes only with its receive: both must be at the head of their
streams, with the compute work posted before each of them done (a large NCCL send cannot
finish before the peer's receive runs). How torch maps transfers to streams:

- "link direction": each direction of each link its own communicator (the pipeline axis's
  ``reverse`` group with lazily created per-pair communicators: megatron3d on NCCL);
- "direction": one stream per group (the same two groups with a bound ``device_id``);
- "pair": one stream per pair of ranks (one group, lazy per-pair communicators);
- "rank": one stream for all of a rank's transfers (one group with a bound ``device_id``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable

import pytest

from megatron3d.mpu.comm import link_of, link_order
from megatron3d.pipeline.instructions import Exchange, Forward, Instruction
from megatron3d.pipeline.interleaved import interleaved_1f1b, interleaved_forward_only
from megatron3d.pipeline.schedule import forward_only, gpipe, one_f_one_b
from megatron3d.pipeline.simulate import simulate

Link = tuple[int, int, int]
MAPPINGS: dict[str, Callable[[int, Link], Hashable]] = {
    "link direction": lambda rank, link: (rank, link),
    "direction": lambda rank, link: (rank, link[2]),
    "pair": lambda rank, link: (rank, link[:2]),
    "rank": lambda rank, link: rank,
}
Transfer = tuple[str, int, int]  # (field, micro-batch, chunk), as Exchange.transfers()


def _peer(rank: int, p: int, field: str) -> int:
    return (rank + 1) % p if field in ("send_forward", "recv_backward") else (rank - 1) % p


def _comm_order(rank: int, p: int, step: Exchange) -> list[Transfer]:
    """What the engine hands comm (sends, then receives, each in field order), in the order
    ``comm.start_exchange`` posts it on NCCL."""
    given = sorted(step.transfers(), key=lambda t: t[0].startswith("recv"))
    links = [(_peer(rank, p, field), field.startswith("send")) for field, *_ in given]
    return [given[k] for k in link_order(rank, links)]


def _finishes(programs: list[list[Instruction]], mapping: Callable[[int, Link], Hashable],
              order: Callable[[int, int, Exchange], list[Transfer]] = _comm_order) -> bool:
    """Whether every rank's program runs to its end on the model's streams."""
    p = len(programs)
    streams: dict[Hashable, deque] = {}  # stream -> (message, rank, compute items before it)
    counts: dict[tuple, int] = {}  # FIFO per (sender, receiver): k-th send meets k-th receive
    compute = [_post(rank, p, program, mapping, order, streams, counts)
               for rank, program in enumerate(programs)]
    done: set = set()
    ran = [0] * p
    moved = True
    while moved:
        moved = False
        for rank, items in enumerate(compute):
            while ran[rank] < len(items) and (items[ran[rank]] is None
                                              or items[ran[rank]] in done):
                ran[rank] += 1
                moved = True
        heads: dict = {}
        for stream, queue in streams.items():
            if queue and ran[queue[0][1]] >= queue[0][2]:
                heads.setdefault(queue[0][0], []).append(stream)
        for message, ends in heads.items():
            if len(ends) == 2:  # the send and its receive meet
                for stream in ends:
                    streams[stream].popleft()
                done.add(message)
                moved = True
    return all(not queue for queue in streams.values()) and ran == [len(c) for c in compute]


def _post(rank: int, p: int, program: list[Instruction],
          mapping: Callable[[int, Link], Hashable],
          order: Callable[[int, int, Exchange], list[Transfer]],
          streams: dict[Hashable, deque], counts: dict[tuple, int]) -> list:
    """Post rank ``rank``'s transfers on ``streams``; its compute stream: None for a
    computation, a message for a wait."""
    compute: list = []
    received: dict[tuple, tuple] = {}
    sending: list[tuple] = []
    for step in program:
        if not isinstance(step, Exchange):
            key = ("F" if isinstance(step, Forward) else "B", step.micro_batch, step.chunk)
            if key in received:  # else the first or last virtual stage: nothing to read
                compute.append(received.pop(key))
            compute.append(None)
            continue
        posted = []
        for field, mb, chunk in order(rank, p, step):
            peer, is_send = _peer(rank, p, field), field.startswith("send")
            pair = (rank, peer) if is_send else (peer, rank)
            message = (pair, counts.get((pair, is_send), 0))
            counts[pair, is_send] = message[1] + 1
            streams.setdefault(mapping(rank, link_of(rank, peer, is_send)), deque()).append(
                (message, rank, len(compute)))
            if is_send:
                posted.append(message)
            else:
                received["F" if field == "recv_forward" else "B", mb, chunk] = message
        compute += sending  # the previous exchange's sends, once this one is posted
        sending = posted
    return compute + sending


def _schedules():
    """(name, programs, chunks) of every schedule family at PP 2..8."""
    for p in range(2, 9):
        for m in sorted({1, 2, p - 1, p, 2 * p + 1}):
            for name, make in (("1f1b", one_f_one_b), ("gpipe", gpipe),
                               ("forward_only", forward_only)):
                yield f"{name} p={p} m={m}", [make(p, r, m) for r in range(p)], 1
        for v in (2, 3, 4):
            for m in (p, 2 * p):
                yield (f"interleaved p={p} v={v} m={m}",
                       [interleaved_1f1b(p, r, m, v) for r in range(p)], v)
                yield (f"interleaved forward_only p={p} v={v} m={m}",
                       [interleaved_forward_only(p, r, m, v) for r in range(p)], v)


@pytest.mark.parametrize("mapping", list(MAPPINGS))
def test_every_schedule_finishes_as_nccl_runs_it(mapping: str) -> None:
    """Each program is accepted by the blocking simulator, then finishes on the streams."""
    stuck = []
    for name, programs, chunks in _schedules():
        simulate(programs, chunks=chunks)
        if not _finishes(programs, MAPPINGS[mapping]):
            stuck.append(name)
    assert not stuck, f"deadlock on {mapping} streams: {stuck}"


def test_the_model_finds_the_deadlock_link_order_avoids() -> None:
    """Posting every send before any receive, one by one on one stream per pair (one group,
    no link order), deadlocks 1F1B at PP = 2: both ranks send first in the steady state.
    Link order on the same streams finishes."""
    programs = [one_f_one_b(2, r, 4) for r in range(2)]

    def sends_first(rank: int, p: int, step: Exchange) -> list[Transfer]:
        return sorted(step.transfers(), key=lambda t: t[0].startswith("recv"))

    assert not _finishes(programs, MAPPINGS["pair"], sends_first)
    assert _finishes(programs, MAPPINGS["pair"])
