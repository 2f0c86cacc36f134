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

import os
from typing import Any

import torch
import torch.distributed as dist

_SIZE = torch.int64


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


def local_world_size(world_size: int) -> int:
    """Ranks per node, from torchrun's environment (the whole world when not launched)."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(value) if value.isdigit() and int(value) > 0 else world_size


class PeerLink:
    """This rank's end of the local-checkpoint group: blobs to and from other ranks, and the
    small agreements of a restore. Every method is a call all named ranks make."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        nodes = local_world_size(world_size)
        self.peer = peer_of(rank, world_size, nodes)
        self.source = source_of(rank, world_size, nodes)
        self.group = dist.new_group(backend="gloo") if world_size > 1 else None

    def swap(self, outgoing: bytearray) -> memoryview:
        """Send ``outgoing`` to the peer and return what the source sent (lengths first)."""
        if self.group is None:
            return memoryview(outgoing)
        size = torch.zeros(1, dtype=_SIZE)
        self._both([(torch.tensor([len(outgoing)], dtype=_SIZE), self.peer)],
                   [(size, self.source)])
        incoming = torch.empty(int(size), dtype=torch.uint8)
        self._both([(_as_tensor(outgoing), self.peer)] if outgoing else [],
                   [(incoming, self.source)] if incoming.numel() else [])
        return memoryview(incoming.numpy())

    def send(self, blob: bytearray, to: int) -> None:
        self._both([(torch.tensor([len(blob)], dtype=_SIZE), to)], [])
        if blob:
            self._both([(_as_tensor(blob), to)], [])

    def receive(self, source: int) -> memoryview:
        size = torch.zeros(1, dtype=_SIZE)
        self._both([], [(size, source)])
        blob = torch.empty(int(size), dtype=torch.uint8)
        if blob.numel():
            self._both([], [(blob, source)])
        return memoryview(blob.numpy())

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

    def _both(self, sends: list[tuple[torch.Tensor, int]],
              recvs: list[tuple[torch.Tensor, int]]) -> None:
        works = [dist.isend(t, dst=r, group=self.group) for t, r in sends]
        works += [dist.irecv(t, src=r, group=self.group) for t, r in recvs]
        for work in works:
            work.wait()


def _as_tensor(blob: bytearray) -> torch.Tensor:
    return torch.frombuffer(blob, dtype=torch.uint8)  # a view: no copy
