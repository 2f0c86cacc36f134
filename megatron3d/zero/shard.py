"""The part of a stage's parameters this rank updates, and where its gradients are.

Without ZeRO a rank updates everything and reads gradients from the flat grad buffer. With
ZeRO-1 and ZeRO-3 a rank updates the r-th 1/DP slice ("piece") of every bucket of the
``FlatLayout``; the gradients of its pieces arrive by reduce-scatter in a separate buffer of
1/DP of the size ("local" coordinates). The model-dtype parameters of a piece live in the
full flat parameter buffer (ZeRO-0/1) or, under ZeRO-3, only in this rank's local parameter
shard. The optimizer and checkpoints work only in terms of this object, so they are the same
code for every stage.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from megatron3d.zero.layout import FlatLayout, Segment


@dataclass(frozen=True)
class Piece:
    """Flat range [start, end) held locally at [local, local + end - start)."""

    start: int
    end: int
    local: int


class Shard:
    """``flat_params``: the full flat parameter buffer (ZeRO-0/1), or None when the
    parameters of the pieces live in ``local_params`` (ZeRO-3). ``accumulates``: the local
    gradients are summed into over micro-batches, so zero_grad clears them."""

    def __init__(self, layout: FlatLayout, pieces: list[Piece], grads: torch.Tensor,
                 flat_params: torch.Tensor | None, local_params: torch.Tensor | None,
                 zeroed: tuple[torch.Tensor, ...], is_whole: bool = False) -> None:
        self.layout = layout
        self.pieces = pieces
        self.grads = grads  # fp32 gradients of the pieces, in local coordinates
        self.flat_params = flat_params
        self.local_params = local_params
        self._zeroed = zeroed
        self.numel = sum(p.end - p.start for p in pieces)
        self.is_whole = is_whole  # grads is the flat gradient buffer itself
        source = flat_params if flat_params is not None else local_params
        self.params_dtype = source.dtype

    @classmethod
    def whole(cls, layout: FlatLayout, params: torch.Tensor, grads: torch.Tensor) -> Shard:
        """Everything, read straight from the flat buffers (no ZeRO)."""
        return cls(layout, [Piece(0, layout.numel, 0)], grads, params, None, (grads,),
                   is_whole=True)

    @classmethod
    def sliced(cls, layout: FlatLayout, dp_rank: int, dp_size: int,
               flat_params: torch.Tensor | None, dtype: torch.dtype,
               device: torch.device, zeroed: tuple[torch.Tensor, ...] = ()) -> Shard:
        """Slice ``dp_rank`` of every bucket, with its own gradient buffer. Without
        ``flat_params`` (ZeRO-3) a local parameter buffer is allocated and the local
        gradients accumulate over micro-batches."""
        pieces, local = [], 0
        for bucket in layout.buckets:
            n = bucket.numel // dp_size
            start = bucket.start + dp_rank * n
            pieces.append(Piece(start, start + n, local))
            local += n
        grads = torch.zeros(local, dtype=torch.float32, device=device)
        local_params = None
        if flat_params is None:
            local_params = torch.zeros(local, dtype=dtype, device=device)
            zeroed = (*zeroed, grads)
        return cls(layout, pieces, grads, flat_params, local_params, zeroed)

    def zero_grad(self) -> None:
        for t in self._zeroed:
            t.zero_()

    def param_part(self, start: int, end: int, local: int) -> torch.Tensor:
        """The model-dtype parameters of flat range [start, end), held at ``local``."""
        if self.local_params is not None:
            return self.local_params[local:local + end - start]
        return self.flat_params[start:end]

    def overlaps(self, start: int, end: int) -> Iterator[tuple[int, int, int]]:
        """(flat_start, flat_end, local_start) of each intersection of [start, end)."""
        for piece in self.pieces:
            lo, hi = max(start, piece.start), min(end, piece.end)
            if lo < hi:
                yield lo, hi, piece.local + lo - piece.start

    def segment_parts(self) -> Iterator[tuple[Segment, int, int, int]]:
        """(segment, flat_start, flat_end, local_start) of every segment part held here."""
        for seg in self.layout.segments:
            for lo, hi, local in self.overlaps(seg.start, seg.end):
                yield seg, lo, hi, local

    def counted_grads(self) -> list[torch.Tensor]:
        """Views of the local gradients this rank counts in the global norm."""
        return [self.grads[local:local + hi - lo]
                for seg, lo, hi, local in self.segment_parts() if seg.counted]

    def parts_of(self, param: nn.Parameter) -> list[tuple[int, int, int]]:
        """(start, end, local) of each part of ``param`` held here: [start, end) indexes the
        parameter's own flattened elements, ``local`` where they sit in local coordinates."""
        offset = self.layout.offset_of(param)
        return [(lo - offset, hi - offset, local)
                for lo, hi, local in self.overlaps(offset, offset + param.numel())]

    def grads_of(self, params: list[nn.Parameter]) -> list[torch.Tensor]:
        """Views of the local gradients of ``params`` (all of each param without ZeRO)."""
        return [self.grads[local:local + end - start]
                for p in params for start, end, local in self.parts_of(p)]

    def values_of(self, params: list[nn.Parameter]) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """(param, flat view of its values held here) for each part of ``params``: where a
        layout keeps parameters only as shards, checks compare these instead."""
        offset = self.layout.offset_of
        return [(p, self.param_part(offset(p) + s, offset(p) + e, local))
                for p in params for s, e, local in self.parts_of(p)]
