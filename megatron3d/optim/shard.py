"""The part of the flat buffers this rank updates, and where its gradients are.

Without ZeRO a rank updates everything and reads gradients from the flat grad buffer. With
ZeRO-1 a rank updates the r-th 1/DP slice ("piece") of every bucket; the gradients of its
pieces arrive by reduce-scatter in a separate buffer of 1/DP of the size ("local"
coordinates), and the updated parameters are all-gathered afterwards. The optimizer works
only in terms of this object, so it is the same code for both.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from megatron3d.optim.flat_buffers import FlatBuffers, Segment


@dataclass(frozen=True)
class Piece:
    """Flat range [start, end) held locally at [local, local + end - start)."""

    start: int
    end: int
    local: int


class Shard:
    def __init__(self, buffers: FlatBuffers, pieces: list[Piece], grads: torch.Tensor) -> None:
        self.buffers = buffers
        self.pieces = pieces
        self.grads = grads  # fp32 gradients of the pieces, in local coordinates
        self.numel = sum(p.end - p.start for p in pieces)

    @classmethod
    def whole(cls, buffers: FlatBuffers) -> Shard:
        """Everything, read straight from the flat grad buffer (no ZeRO)."""
        return cls(buffers, [Piece(0, buffers.grads.numel(), 0)], buffers.grads)

    @classmethod
    def zero1(cls, buffers: FlatBuffers, dp_rank: int, dp_size: int) -> Shard:
        """Slice ``dp_rank`` of every bucket, with its own gradient buffer."""
        pieces, local = [], 0
        for bucket in buffers.buckets:
            n = bucket.numel // dp_size
            start = bucket.start + dp_rank * n
            pieces.append(Piece(start, start + n, local))
            local += n
        grads = torch.zeros(local, dtype=torch.float32, device=buffers.grads.device)
        return cls(buffers, pieces, grads)

    @property
    def is_whole(self) -> bool:
        return self.grads is self.buffers.grads

    def overlaps(self, start: int, end: int) -> Iterator[tuple[int, int, int]]:
        """(flat_start, flat_end, local_start) of each intersection of [start, end)."""
        for piece in self.pieces:
            lo, hi = max(start, piece.start), min(end, piece.end)
            if lo < hi:
                yield lo, hi, piece.local + lo - piece.start

    def segment_parts(self) -> Iterator[tuple[Segment, int, int, int]]:
        """(segment, flat_start, flat_end, local_start) of every segment part held here."""
        for seg in self.buffers.segments:
            for lo, hi, local in self.overlaps(seg.start, seg.end):
                yield seg, lo, hi, local

    def counted_grads(self) -> list[torch.Tensor]:
        """Views of the local gradients this rank counts in the global norm."""
        return [self.grads[local:local + hi - lo]
                for seg, lo, hi, local in self.segment_parts() if seg.counted]

    def parts_of(self, param: nn.Parameter) -> list[tuple[int, int, int]]:
        """(start, end, local) of each part of ``param`` held here: [start, end) indexes the
        parameter's own flattened elements, ``local`` where they sit in local coordinates."""
        offset = self.buffers.offset_of(param)
        return [(lo - offset, hi - offset, local)
                for lo, hi, local in self.overlaps(offset, offset + param.numel())]

    def grads_of(self, params: list[nn.Parameter]) -> list[torch.Tensor]:
        """Views of the local gradients of ``params`` (all of each param without ZeRO)."""
        views = []
        for p in params:
            start = self.buffers.offset_of(p)
            views += [self.grads[local:local + hi - lo]
                      for lo, hi, local in self.overlaps(start, start + p.numel())]
        return views
