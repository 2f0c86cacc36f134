"""Checkpoint contents as layout-independent chunks, and their reassembly for any layout.

A chunk is a piece of one logical tensor ("layers.3.mlp.fc1.weight", kind "weight",
"exp_avg" or "exp_avg_sq"): the range [start, end) of the flattened local slice that TP rank
``tp_rank`` of ``tp_size`` holds, plus how that slice was cut from the logical tensor (split
dimension and stride, padded vocabulary rows). Each rank writes only the chunks it owns:
its ZeRO slice (or, without ZeRO, data-parallel rank 0 all of it; under hybrid ZeRO-3 the
first node's ranks), TP-replicated tensors from TP rank 0, tied copies from the first
stage. Nothing is gathered to one rank when saving.

Loading into any layout: each rank copies from the chunks overlapping its own pieces only
what it holds (``shard_reader.py``, ``overlap.py``); the offline tools join a logical tensor
from all its chunks (``assemble``) and cut it again for a layout (``tp_slice``).

Why not torch.distributed.checkpoint: it reshards tensors described as DTensor or
ShardedTensor placements (even, contiguous shards per dimension). Ours are not: a SwiGLU
weight is split with stride 2 (each rank holds a gate block and an up block), vocabulary
tables carry layout-dependent padding rows, and ZeRO slices cut flat buffers across parameter
boundaries. Describing those as placements would mean faking the layout; the chunk form says
exactly what each rank holds and reuses the one definition of the layout (``sharding.py``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from megatron3d.checkpoint.tiling import overlapping
from megatron3d.errors import CheckpointError
from megatron3d.mpu.meta import ParamMeta
from megatron3d.mpu.replicas import counted_once
from megatron3d.mpu.sharding import tp_shard, tp_unshard
from megatron3d.mpu.state import AxisGroup, ParallelState
from megatron3d.zero.shard import Shard

KINDS = ("weight", "exp_avg", "exp_avg_sq")


def owns(param: nn.Parameter, state: ParallelState, replicas: list[AxisGroup]) -> bool:
    """Whether this rank writes ``param``'s chunks (each logical element exactly once):
    ``replicas`` are the axes of ranks holding copies of this rank's shard (the optimizer's
    ``replica_axes``: dp x cp without ZeRO, the other nodes under hybrid ZeRO-3), of which
    the first writes."""
    return counted_once(state, param) and all(axis.rank == 0 for axis in replicas)


def owned_parts(params: list[nn.Parameter], shard: Shard, state: ParallelState,
                replicas: list[AxisGroup]) -> Iterator[tuple[nn.Parameter, int, int, int]]:
    """(parameter, start, end, local offset) of every piece this rank writes, in the order
    of its chunks: the one walk that saving, the async snapshot and the same-layout load
    check share."""
    for p in params:
        if owns(p, state, replicas):
            for start, end, offset in shard.parts_of(p):
                yield p, start, end, offset


def new_chunk(meta: ParamMeta, kind: str, tp_rank: int, tp_size: int,
              local_shape: tuple[int, ...], start: int, end: int, data: torch.Tensor) -> dict:
    """The chunk holding ``data``: elements [start, end) of the flattened ``local_shape``
    slice that TP rank ``tp_rank`` of ``tp_size`` holds of ``meta``'s logical tensor."""
    split = meta.tp_split_dim is not None  # a replicated tensor is its logical tensor
    return {"name": meta.name, "kind": kind, "tp_size": tp_size if split else 1,
            "tp_rank": tp_rank if split else 0, "split_dim": meta.tp_split_dim,
            "stride": meta.tp_stride, "logical_rows": meta.logical_rows,
            "local_shape": local_shape, "start": start, "end": end, "data": data}


def index_chunks(chunks: Iterable[dict]) -> dict[tuple[str, str], list[dict]]:
    index: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for chunk in chunks:
        index[(chunk["name"], chunk["kind"])].append(chunk)
    return index


def assemble(name: str, kind: str, chunks: list[dict]) -> torch.Tensor:
    """The logical tensor (padding rows dropped) from all its chunks."""
    first = chunks[0]
    slices = [torch.empty(first["local_shape"], dtype=torch.float32)
              for _ in range(first["tp_size"])]
    ranges: list[list[tuple[int, int]]] = [[] for _ in range(first["tp_size"])]
    for c in chunks:
        slices[c["tp_rank"]].view(-1)[c["start"]:c["end"]] = c["data"]
        ranges[c["tp_rank"]].append((c["start"], c["end"]))
    numel = slices[0].numel()
    for tp_rank, found in enumerate(ranges):
        gap = _untiled(found, numel)
        if gap is not None:
            raise CheckpointError(f"checkpoint is incomplete: {name} ({kind}) of TP rank "
                                  f"{tp_rank} {gap}; a shard file is missing, truncated or "
                                  "damaged, load an earlier checkpoint")
    full = slices[0] if first["split_dim"] is None else tp_unshard(
        slices, first["split_dim"], first["stride"])
    return full if first["logical_rows"] is None else full[: first["logical_rows"]]


def _untiled(ranges: list[tuple[int, int]], numel: int) -> str | None:
    """What keeps element ranges (each inside [0, numel), as ``payload`` checked) from
    covering [0, numel) exactly once, or None."""
    if overlapping([((start,), (end - start,)) for start, end in ranges]):
        return "holds overlapping chunks"
    held = sum(end - start for start, end in ranges)
    return None if held == numel else f"has {held} of {numel} elements"


def tp_slice(logical: torch.Tensor, meta: ParamMeta, tp_rank: int, tp_size: int,
             padded_rows: int) -> torch.Tensor:
    """TP rank ``tp_rank``'s slice of a logical tensor; a vocabulary table is first padded to
    ``padded_rows`` rows (the padded vocabulary of that layout). Loading and offline
    relayout both cut slices here, so they agree with training's layout."""
    if meta.tp_split_dim is None:
        return logical
    full = logical
    if meta.logical_rows is not None:
        full = torch.zeros((padded_rows, *logical.shape[1:]), dtype=logical.dtype)
        full[: logical.shape[0]] = logical
    return tp_shard(full, meta.tp_split_dim, tp_rank, tp_size, meta.tp_stride)
