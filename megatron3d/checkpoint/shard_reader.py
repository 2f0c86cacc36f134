"""Fill a rank's optimizer shard from a checkpoint, reading only what the rank owns.

Same layout: a rank's own file holds the chunks it wrote, which are its ZeRO pieces of
every tensor it owns (``chunks.owns``); what it holds but does not own is a copy that training
keeps identical to a peer's owned one (a tied weight on the last stage, a TP-replicated
tensor off TP rank 0, everything off DP rank 0 without ZeRO), so it is received from that
peer and only the rank's own file is read. This holds only if every rank's file holds exactly
what the rank would write now (same pieces: the same bucket size, partitioning, model); the
ranks check and agree, else they load as from another layout.

Another layout: the chunk index (``chunk_index.py``) says which saved chunks overlap this
rank's ZeRO pieces; only the files holding them are opened (memory-mapped) and only the
overlapping elements copied, box by box (``overlap.py``), straight into the shard's buffers,
so no rank builds a logical tensor or reads another rank's part. Every needed element must be
found exactly once. A problem met on any rank stops every rank with its one-line message: a
rank that failed alone would leave the others waiting in the next collective.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from megatron3d.checkpoint import chunk_index, io
from megatron3d.checkpoint.chunk_index import Entry, Piece
from megatron3d.checkpoint.chunks import KINDS, new_chunk, owned_parts
from megatron3d.checkpoint.overlap import (
    Box,
    FilePages,
    Geometry,
    copy_box,
    logical_shape,
    shared,
    size,
)
from megatron3d.checkpoint.payload import CHUNK_KEYS
from megatron3d.errors import CheckpointError
from megatron3d.mpu import comm
from megatron3d.mpu.meta import get_meta
from megatron3d.mpu.state import AxisGroup, ParallelState
from megatron3d.zero.shard import Shard

T = TypeVar("T")
_MESSAGE_BYTES = 2048  # of a failing rank's message, sent to the others


def targets(shard: Shard, moments: bool) -> dict[str, torch.Tensor]:
    """Zeroed buffers for the loaded kinds in the shard's local coordinates. The weights go
    into the gradient buffer, idle until the first backward (the caller zeroes it again once
    the optimizer took them), so a load adds only the moments' buffers to the optimizer's."""
    assert shard.grads.numel() == shard.numel, "the gradient buffer is in local coordinates"
    found = {"weight": shard.grads.zero_()}
    if moments:
        found.update((kind, torch.zeros_like(shard.grads)) for kind in KINDS[1:])
    return found


def read(directory: Path, meta: dict[str, Any], state: ParallelState,
         params: list[nn.Parameter], shard: Shard, found: dict[str, torch.Tensor],
         kinds: tuple[str, ...], replicas: list[AxisGroup],
         same_layout: bool) -> dict[str, Any] | None:
    """Fill ``found`` (from ``targets``) with the saved ``kinds``; this rank's saved RNG
    states if the layout is the same (None if not, or if the file holds none). ``replicas``:
    the axes of ranks holding copies of this rank's shard (``chunks.owns``)."""
    device = found["weight"].device
    own = None
    if same_layout:
        own = together(state, device, lambda: chunk_index.open_rank(directory, meta,
                                                                     state.world_rank))
        mine = _what_i_write(params, shard, state, replicas, kinds)
        theirs = Counter(_description(c) for c in own["chunks"] if c["kind"] in kinds)
        same_layout = not comm.any_rank(mine != theirs, state.world, device)
    if same_layout:  # and every rank's own file holds what it would write now
        together(state, device, lambda: _copy_own(directory, state.world_rank, own, params,
                                                  shard, found, kinds))
        _receive_copies(params, shard, found, state, replicas)
    else:
        opened = {} if own is None else {state.world_rank: own}
        together(state, device, lambda: _copy_overlaps(directory, meta, params, state, shard,
                                                       found, kinds, opened))
    return None if own is None else own["rng"]


def together(state: ParallelState, device: torch.device, work: Callable[[], T]) -> T:
    """``work()`` on every rank; if it raised ``CheckpointError`` anywhere, the first failing
    rank's message is raised on every rank."""
    try:
        result, message = work(), b""
    except CheckpointError as err:
        result, message = None, str(err).encode()[:_MESSAGE_BYTES] or b"?"
    first = torch.tensor([state.world_rank if message else state.world_size], device=device)
    first = int(comm.all_reduce(first, state.world, op=comm.MIN).item())
    if first == state.world_size:
        return result
    text = torch.zeros(_MESSAGE_BYTES, dtype=torch.uint8)
    if message:  # the ranks that succeeded receive the failing rank's message
        text[:len(message)] = torch.frombuffer(bytearray(message), dtype=torch.uint8)
    text = comm.broadcast(text.to(device), state.world, src_index=first).cpu()
    raise CheckpointError(bytes(text.tolist()).rstrip(b"\0").decode(errors="replace"))


def _description(chunk: dict) -> tuple:
    return tuple(tuple(chunk[k]) if k == "local_shape" else chunk[k] for k in CHUNK_KEYS
                 if k != "data")


def _what_i_write(params: list[nn.Parameter], shard: Shard, state: ParallelState,
                  replicas: list[AxisGroup], kinds: tuple[str, ...]) -> Counter:
    """The descriptions of the chunks of ``kinds`` this rank saves (``snapshot.HostSnapshot``)."""
    return Counter(_description(new_chunk(get_meta(p), kind, state.tp.rank, state.tp.size,
                                          tuple(p.shape), start, end, None))
                   for p, start, end, _ in owned_parts(params, shard, state, replicas)
                   for kind in kinds)


def _copy_own(directory: Path, rank: int, own: dict[str, Any], params: list[nn.Parameter],
              shard: Shard, found: dict[str, torch.Tensor], kinds: tuple[str, ...]) -> None:
    """Each chunk of the rank's own file into the piece it was saved from."""
    pages = FilePages(io.rank_file(directory, rank))
    local = {(get_meta(p).name, start, end): at
             for p in params for start, end, at in shard.parts_of(p)}
    for c in own["chunks"]:
        if c["kind"] in kinds:
            n = c["end"] - c["start"]
            flat = Geometry(1, n, 0, n)
            at = local[(c["name"], c["start"], c["end"])]
            copy_box(found[c["kind"]], flat, -at, c["data"], flat, 0, (0, 1, 0, n), pages)
    _check_finite(directory, params, shard, found, kinds)


def _receive_copies(params: list[nn.Parameter], shard: Shard, found: dict[str, torch.Tensor],
                    state: ParallelState, replicas: list[AxisGroup]) -> None:
    """Same layout: the pieces this rank holds but does not own, from the peer that does
    (tied copies from the first stage, then TP replicas from TP rank 0, then everything from
    the first of the shard's replicas (rank 0 of dp x cp without ZeRO, the first node under
    hybrid ZeRO-3), each peer passing on what it just received). Tied weights are laid out
    alone, so their pieces line up across stages."""
    def pieces(keep: Callable[[nn.Parameter], bool]) -> list[torch.Tensor]:
        return [t[at:at + end - start] for p in params if keep(p)
                for start, end, at in shard.parts_of(p) for t in found.values()]

    if state.embedding.is_member and state.embedding.size > 1:
        for piece in pieces(lambda p: get_meta(p).tied_key is not None):
            comm.broadcast(piece, state.embedding, src_index=0)
    for piece in pieces(lambda p: get_meta(p).tp_split_dim is None):
        comm.broadcast(piece, state.tp, src_index=0)
    for axis in replicas:
        for t in found.values():
            comm.broadcast(t, axis, src_index=0)


@dataclass(frozen=True)
class _Copy:
    """Boxes of one saved chunk that land in one of this rank's pieces."""

    name: str
    kind: str
    origin: int  # the piece's first element of the slice, less its local offset
    mine: Geometry
    piece: Piece
    theirs: Geometry
    boxes: list[Box]


def _copy_overlaps(directory: Path, meta: dict[str, Any], params: list[nn.Parameter],
                   state: ParallelState, shard: Shard, found: dict[str, torch.Tensor],
                   kinds: tuple[str, ...], opened: dict[int, dict]) -> None:
    """Another layout: open only the rank files holding chunks that overlap this rank's
    pieces (``opened``: files already open, by rank) and copy the overlaps."""
    index = chunk_index.read_index(directory, meta, opened)
    plan: dict[int, list[_Copy]] = defaultdict(list)
    for p in params:
        for kind in kinds:
            for copy in _overlaps(directory, index, p, state, shard, kind):
                plan[copy.piece.rank].append(copy)
    for rank in sorted(plan):
        _copy_from(directory, meta, rank, plan[rank], found, opened)
    opened.clear()
    _check_finite(directory, params, shard, found, kinds)


def _copy_from(directory: Path, meta: dict[str, Any], rank: int, copies: list[_Copy],
               found: dict[str, torch.Tensor], opened: dict[int, dict]) -> None:
    """The boxes ``copies`` name, from rank file ``rank`` (unmapped on return)."""
    loaded = opened.pop(rank, None) or chunk_index.open_rank(directory, meta, rank)
    chunks = {(c["name"], c["kind"], c["tp_rank"], c["start"], c["end"]): c
              for c in loaded["chunks"]}
    pages = FilePages(io.rank_file(directory, rank))
    for copy in copies:
        chunk = chunks.get((copy.name, copy.kind, copy.piece.tp_rank, copy.piece.start,
                            copy.piece.end))
        if chunk is None:
            raise CheckpointError(f"{io.rank_file(directory, rank)} lacks the chunk of "
                                  f"{copy.name} ({copy.kind}) that {chunk_index.INDEX} "
                                  "lists: one of them is damaged, load an earlier checkpoint")
        for box in copy.boxes:
            copy_box(found[copy.kind], copy.mine, copy.origin, chunk["data"], copy.theirs,
                     copy.piece.start, box, pages)


def _overlaps(directory: Path, index: chunk_index.Index, p: nn.Parameter,
              state: ParallelState, shard: Shard, kind: str) -> list[_Copy]:
    """The saved chunks overlapping this rank's pieces of ``p``, which they must cover
    exactly once (padding aside)."""
    meta = get_meta(p)
    entry = index.get((meta.name, kind))
    if entry is None:
        raise CheckpointError(f"{directory} has no {kind} of {meta.name}: a shard file is "
                              "missing, or the model differs")
    _check_fits(entry, p, state)
    mine = Geometry.of(tuple(p.shape), meta.tp_split_dim, meta.tp_stride, meta.logical_rows,
                       state.tp.rank, state.tp.size)
    copies = []
    for start, end, at in shard.parts_of(p):
        wanted = mine.boxes(start, end)
        needed = sum(size(b) for a in wanted if (b := shared(a, a, mine.real)))
        got = 0
        for piece in entry.pieces:
            theirs = (entry.geometry(piece.tp_rank) if entry.tp_size > 1 else  # whole: cut
                      Geometry.of(entry.local_shape, meta.tp_split_dim, meta.tp_stride,
                                  meta.logical_rows, 0, 1))  # as this model cuts it
            boxes = [box for a in wanted for b in theirs.boxes(piece.start, piece.end)
                     if (box := shared(a, b, mine.real)) is not None]
            got += sum(map(size, boxes))
            if boxes:
                copies.append(_Copy(meta.name, kind, start - at, mine, piece, theirs, boxes))
        if got != needed:
            raise CheckpointError(f"checkpoint is incomplete: {directory} holds {got} of the "
                                  f"{needed} elements of {meta.name} ({kind}) in [{start}, "
                                  f"{end}) of TP rank {state.tp.rank}'s slice; a shard file "
                                  "is missing or damaged, load an earlier checkpoint")
    return copies


def _check_fits(entry: Entry, p: nn.Parameter, state: ParallelState) -> None:
    """The saved slices cut the tensor this parameter is a slice of, in the same way, or
    are the whole tensor (a TP size of 1, as converted checkpoints describe theirs)."""
    meta = get_meta(p)
    split = meta.tp_split_dim is not None
    shape = logical_shape(tuple(p.shape), meta.tp_split_dim, state.tp.size if split else 1,
                          meta.logical_rows)
    same_cut = entry.tp_size == 1 or (entry.split_dim, entry.stride, entry.logical_rows) == (
        meta.tp_split_dim, meta.tp_stride, meta.logical_rows)
    if entry.logical_shape != shape or not same_cut:
        raise CheckpointError(f"checkpoint tensor {meta.name} has logical shape "
                              f"{entry.logical_shape}, which does not fit this model's "
                              f"{tuple(p.shape)} slice: the model flags differ from the "
                              "checkpoint's (try --use-checkpoint-args)")


def _check_finite(directory: Path, params: list[nn.Parameter], shard: Shard,
                  found: dict[str, torch.Tensor], kinds: tuple[str, ...]) -> None:
    """Saving refuses NaN and Inf, so one found here means a damaged file, refused before
    it is trained on. The extremes tell (NaN propagates), with no copy of the buffers as
    ``isfinite`` would make."""
    def finite(t: torch.Tensor) -> bool:
        return bool(torch.isfinite(torch.stack(torch.aminmax(t))).all())

    for kind in kinds:
        if finite(found[kind]):
            continue
        name = next(get_meta(p).name for p in params for start, end, at in shard.parts_of(p)
                    if not finite(found[kind][at:at + end - start]))
        raise CheckpointError(f"{directory} holds NaN or Inf in {name} ({kind}), which no "
                              "save writes: the checkpoint is damaged, load an earlier one")
