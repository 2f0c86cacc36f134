"""Where every parameter of a stage sits in one flat index space, cut into buckets.

A bucket is the unit of data-parallel communication: ZeRO-0/1 reduce one bucket's gradients
per collective, ZeRO-3 gathers and reduce-scatters one unit (a layer's parameters) per
collective. Each bucket is padded to a multiple of ``align`` (the DP size) so every DP rank
owns an equal contiguous slice of it. The layout is metadata only: the ZeRO-0/1 buffers
(``buffers.py``) and the ZeRO-3 shards (``stage3/``) both index by it, so the optimizer,
checkpoints and norm counting see one description for every stage.

Segments are runs of parameters with the same weight decay and norm counting; they never
cross a bucket, so the optimizer can treat each segment part as one flat tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from megatron3d.mpu.meta import get_meta

Counted = Callable[[nn.Parameter], bool]
"""Whether this rank counts a parameter in the global grad norm (False for copies another
rank also counts: TP replicas off TP rank 0, tied copies off the first stage)."""

Chunks = dict[int, frozenset[int]]
"""``id(param)`` -> the model chunks (interleaving) whose layers use it, from
``param_chunks``; every parameter of a stage without interleaving is in chunk 0."""


def param_chunks(layers: list[nn.Module], chunk_sizes: tuple[int, ...]) -> Chunks:
    """Which chunks use each parameter of ``layers``, the first ``chunk_sizes[0]`` of which
    form chunk 0, the next ``chunk_sizes[1]`` chunk 1, and so on."""
    chunks: dict[int, frozenset[int]] = {}
    layer = 0
    for chunk, size in enumerate(chunk_sizes):
        for module in layers[layer:layer + size]:
            for p in module.parameters():
                chunks[id(p)] = chunks.get(id(p), frozenset()) | {chunk}
        layer += size
    return chunks


@dataclass(frozen=True)
class Segment:
    """A contiguous run of parameters that share weight decay and norm counting."""

    start: int
    end: int
    no_weight_decay: bool
    counted: bool
    names: tuple[str, ...]


@dataclass(frozen=True)
class Bucket:
    """A padded range of the flat index space communicated as one collective."""

    start: int
    end: int
    params: tuple[nn.Parameter, ...]

    @property
    def numel(self) -> int:
        return self.end - self.start


class FlatLayout:
    """Buckets of parameter groups, back to back, each padded to ``align`` elements."""

    def __init__(self, groups: list[list[nn.Parameter]], counted: Counted, align: int) -> None:
        self.buckets: list[Bucket] = []
        self.segments: list[Segment] = []
        self._offsets: dict[int, int] = {}
        start = 0
        for group in groups:
            size = sum(p.numel() for p in group)
            bucket = Bucket(start, start + -(-size // align) * align, tuple(group))
            self.buckets.append(bucket)
            self._place(bucket, counted)
            start = bucket.end
        self.numel = start

    @classmethod
    def bucketed(cls, params: list[nn.Parameter], counted: Counted, bucket_numel: int | None,
                 align: int, chunks: Chunks | None = None) -> FlatLayout:
        """ZeRO-0/1: tied parameters first (alone, so every stage holding a copy lays it out
        identically and the copies' ZeRO slices line up), then the rest in backward order
        cut near ``bucket_numel`` elements, so a bucket completes early in backward. A bucket
        never mixes parameters of different ``chunks``: it would wait for both chunks' last
        backward."""
        tied = [p for p in params if get_meta(p).tied_key is not None]
        rest = [p for p in reversed(params) if get_meta(p).tied_key is None]
        groups = [[p] for p in tied]
        limit = bucket_numel or sum(p.numel() for p in rest) or 1
        chunk_of = chunks or {}
        current: list[nn.Parameter] = []
        size = 0
        for p in rest:
            if current and chunk_of.get(id(p)) != chunk_of.get(id(current[0])):
                groups.append(current)
                current, size = [], 0
            current.append(p)
            size += p.numel()
            if size >= limit:
                groups.append(current)
                current, size = [], 0
        if current:
            groups.append(current)
        return cls(groups, counted, align)

    def _place(self, bucket: Bucket, counted: Counted) -> None:
        offset, run_start, run_key, run_names = bucket.start, bucket.start, None, []
        for p in bucket.params:
            key = (counted(p), get_meta(p).no_weight_decay)
            if key != run_key and run_names:
                self.segments.append(Segment(run_start, offset, run_key[1], run_key[0],
                                             tuple(run_names)))
                run_start, run_names = offset, []
            run_key = key
            run_names.append(get_meta(p).name)
            self._offsets[id(p)] = offset
            offset += p.numel()
        if run_names:
            self.segments.append(Segment(run_start, offset, run_key[1], run_key[0],
                                         tuple(run_names)))

    def offset_of(self, param: nn.Parameter) -> int:
        """Where ``param`` starts in the flat index space."""
        return self._offsets[id(param)]
