"""The process group the non-persistent checkpoints travel on, and who replicates to whom.

A gloo group over every rank, made at build in the same order on every rank, used only by
the local checkpoints: host tensors only, so it works beside NCCL without staging, and the
save thread's transfers never interleave with the training thread's collectives, which go
on their own groups through ``mpu/comm.py`` (a collective issued from a second thread on a
training group would land between the training thread's in an order no rank controls).

Peer: each rank replicates to the same local rank of the next node, so that losing a node
loses no state whose replica lives elsewhere; on one node (or a world that is not whole
nodes) to the next rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from megatron3d.checkpoint.local.priority import made_below_training
from megatron3d.mpu.state import ranks_per_node

_SIZE = torch.int64
MAX_FRAMES = 8  # parts of one message: a header and a copy's few files
Place = Callable[[memoryview, list[int]], list[memoryview] | None]
"""(a message's header frame, the lengths of its other frames) -> the writable buffers to
receive those into, or None for fresh memory."""


def peer_of(rank: int, world_size: int, local_world_size: int) -> int:
    """Whom ``rank`` sends its states to (itself in a one-rank world)."""
    step = _step(world_size, local_world_size)
    return (rank + step) % world_size


def source_of(rank: int, world_size: int, local_world_size: int) -> int:
    """Whose states ``rank`` holds: the rank whose peer it is."""
    step = _step(world_size, local_world_size)
    return (rank - step) % world_size


def _step(world_size: int, local_world_size: int) -> int:
    several_nodes = 0 < local_world_size < world_size and world_size % local_world_size == 0
    return local_world_size if several_nodes else 1


class PeerLink:
    """This rank's end of the local-checkpoint group: frames to and from other ranks, and the
    small agreements of a restore. Every method is a call all named ranks make."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        nodes = ranks_per_node(0, world_size)  # torchrun's, else one node
        self.peer = peer_of(rank, world_size, nodes)
        self.source = source_of(rank, world_size, nodes)
        self.group = (made_below_training(lambda: dist.new_group(backend="gloo"))
                      if world_size > 1 else None)

    def swap(self, outgoing: list[memoryview], place: Place | None = None) -> list[memoryview]:
        """Send the frames ``outgoing`` to the peer and return the source's, received into
        the buffers ``place`` gives (fresh memory without it, or where it gives None)."""
        if self.group is None:
            return outgoing
        return self._exchange(outgoing, self.peer, self.source, place)

    def send(self, parts: list[memoryview], to: int) -> None:
        self._exchange(parts, to, None, None)

    def receive(self, source: int) -> list[memoryview]:
        return self._exchange([], None, source, None)

    def gather(self, mine: Any) -> list[Any]:
        """Every rank's ``mine`` (small plain data), in rank order."""
        if self.group is None:
            return [mine]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, mine, group=self.group)
        return out

    def barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)

    def _exchange(self, outgoing: list[memoryview], to: int | None, source: int | None,
                  place: Place | None) -> list[memoryview]:
        """Frames to ``to`` and from ``source`` (either None: that way is idle), in three
        rounds: the sizes, the first frame (a header saying what the others are), the
        others, received where ``place`` says once it has read the header."""
        sizes = torch.zeros(MAX_FRAMES + 1, dtype=_SIZE)
        self._both(_at(to, [_sizes(outgoing)]), _at(source, [sizes]))
        count, *lengths = sizes.tolist()
        head, rest = lengths[:count][:1], lengths[:count][1:]
        incoming = [memoryview(t.numpy()) for t in _buffers(head)]
        self._both(_at(to, _tensors(outgoing[:1])), _at(source, _tensors(incoming)))
        placed = place(incoming[0], rest) if place is not None and incoming else None
        if placed is None:
            placed = [memoryview(t.numpy()) for t in _buffers(rest)]
        assert [len(p) for p in placed] == rest, "a placed buffer has its frame's length"
        self._both(_at(to, _tensors(outgoing[1:])), _at(source, _tensors(placed)))
        return incoming + placed

    def _both(self, sends: list[tuple[torch.Tensor, int]],
              recvs: list[tuple[torch.Tensor, int]]) -> None:
        works = [dist.isend(t, dst=r, group=self.group) for t, r in sends]
        works += [dist.irecv(t, src=r, group=self.group) for t, r in recvs]
        for work in works:
            work.wait()


def _sizes(parts: list[memoryview]) -> torch.Tensor:
    """[number of frames, each one's length, zeros]: what the receiver allocates."""
    assert len(parts) <= MAX_FRAMES, "a copy is a header and a few files"
    sizes = torch.zeros(MAX_FRAMES + 1, dtype=_SIZE)
    sizes[0] = len(parts)
    sizes[1:len(parts) + 1] = torch.tensor([len(p) for p in parts], dtype=_SIZE)
    return sizes


def _buffers(lengths: list[int]) -> list[torch.Tensor]:
    return [torch.empty(n, dtype=torch.uint8) for n in lengths]


def _tensors(parts: list[memoryview]) -> list[torch.Tensor]:
    """The parts that carry bytes, as tensors gloo sends from or receives into."""
    return [_as_tensor(p) for p in parts if len(p)]


def _at(rank: int | None, tensors: list[torch.Tensor]) -> list[tuple[torch.Tensor, int]]:
    return [] if rank is None else [(t, rank) for t in tensors]


def _as_tensor(part: memoryview) -> torch.Tensor:
    """A view of ``part`` (no copy); a read-only part (bytes read from a file) is copied
    first, since torch views only writable memory."""
    return torch.frombuffer(bytearray(part) if part.readonly else part, dtype=torch.uint8)
