"""Which rank file holds which piece of each logical tensor, known without opening them.

``index.json``, beside ``meta.json``, describes every chunk of the checkpoint (``chunks.py``)
without its data: per (name, kind) the saved slices' layout and, per chunk, its rank file,
TP rank and range. Rank 0 writes it when a save's rank files are all written
(``finish``), so a loader that changes layout opens only the files holding chunks it
needs. A checkpoint without one (saved before it existed), or whose index is damaged or
belongs to another checkpoint, is indexed from its rank files' own chunk lists instead:
every file opened once, memory-mapped, so no tensor data is read. Every file a loader opens
is checked against ``meta.json`` (``safety.check_rank_file``) before it is used.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron3d.checkpoint import io, payload, safety
from megatron3d.checkpoint.overlap import Geometry, logical_shape
from megatron3d.errors import CheckpointError
from megatron3d.log import get_logger

logger = get_logger(__name__)

INDEX = "index.json"
INDEX_BYTES = 1 << 30  # bounds the read: a few hundred bytes per tensor and saving rank
_LAYOUT = ("tp_size", "split_dim", "stride", "logical_rows", "local_shape")


@dataclass(frozen=True)
class Piece:
    """One chunk: elements [start, end) of TP rank ``tp_rank``'s slice, in file ``rank``."""

    rank: int
    tp_rank: int
    start: int
    end: int


@dataclass(frozen=True)
class Entry:
    """The saved chunks of one (name, kind) and the layout of the slices they cut."""

    tp_size: int
    split_dim: int | None
    stride: int
    logical_rows: int | None
    local_shape: tuple[int, ...]
    pieces: list[Piece]

    def geometry(self, tp_rank: int) -> Geometry:
        return Geometry.of(self.local_shape, self.split_dim, self.stride, self.logical_rows,
                           tp_rank, self.tp_size)

    @property
    def logical_shape(self) -> tuple[int, ...]:
        return logical_shape(self.local_shape, self.split_dim, self.tp_size, self.logical_rows)


Index = dict[tuple[str, str], Entry]


def open_rank(directory: Path, meta: dict[str, Any], rank: int) -> dict[str, Any]:
    """Rank file ``rank``, memory-mapped and checked against ``meta``."""
    loaded = io.read_rank(directory, rank)
    safety.check_rank_file(directory, rank, loaded, meta)
    return loaded


def write_index(directory: Path, meta: dict[str, Any]) -> None:
    """Write ``directory/index.json`` from the rank files of the checkpoint ``meta`` describes
    (rank 0, once every rank's file is complete there, before the checkpoint is published)."""
    files = ((rank, open_rank(directory, meta, rank))
             for rank in range(meta["layout"]["world_size"]))
    tensors = [{"name": name, "kind": kind, **{k: getattr(e, k) for k in _LAYOUT},
                "chunks": [[p.rank, p.tp_rank, p.start, p.end] for p in e.pieces]}
               for (name, kind), e in _described(directory, files).items()]
    text = json.dumps({"iteration": meta["iteration"], "layout": meta["layout"],
                       "tensors": tensors}, separators=(",", ":")).encode()
    tmp = directory / (INDEX + ".tmp")
    with open(tmp, "wb") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / INDEX)


def finish(root: Path, meta: dict[str, Any], keep_last: int | None) -> None:
    """Rank 0's part once every rank file is in ``iter_X.tmp``: meta.json, the index,
    ``io.publish``, then ``io.prune`` of ``meta``'s series (``--keep-last-n``); a failed write
    is a ``CheckpointError``."""
    series = io.series_of(meta)
    staging = io.staging_dir(root, meta["iteration"], series)
    with io.writing(root):
        io.write_meta(staging, meta)
        write_index(staging, meta)
        io.publish(root, meta["iteration"], series)
        if keep_last:
            io.prune(root, keep_last, io.series_of(meta))


def read_index(directory: Path, meta: dict[str, Any], opened: dict[int, dict]) -> Index:
    """The checkpoint's index: ``index.json``, else built from every rank file (left open in
    ``opened``, keyed by rank, for the caller to use)."""
    path = directory / INDEX
    if path.exists():
        try:
            return _parse(io.read_small(path, INDEX_BYTES), meta)
        except (OSError, ValueError, RecursionError, CheckpointError) as err:
            logger.warning("%s is not usable (%s): reading the chunk lists of every rank file "
                           "instead", path, str(err)[:160])
    for rank in range(meta["layout"]["world_size"]):
        if rank not in opened:
            opened[rank] = open_rank(directory, meta, rank)
    return _described(directory, sorted(opened.items()))


def _described(directory: Path, files: Iterable[tuple[int, dict]]) -> Index:
    """The index of these (rank, rank file) pairs; chunks of one (name, kind) in different
    files must agree on the layout of the slices they cut."""
    index: Index = {}
    for rank, loaded in files:
        for c in loaded["chunks"]:
            layout = {k: tuple(c[k]) if k == "local_shape" else c[k] for k in _LAYOUT}
            entry = index.setdefault((c["name"], c["kind"]), Entry(**layout, pieces=[]))
            if any(getattr(entry, k) != v for k, v in layout.items()):
                raise CheckpointError(f"{io.rank_file(directory, rank)} holds chunks of "
                                      f"{c['name']} ({c['kind']}) cut from another layout than "
                                      "other rank files: the checkpoint is damaged, load an "
                                      "earlier one")
            entry.pieces.append(Piece(rank, c["tp_rank"], c["start"], c["end"]))
    return index


def _parse(text: bytes, meta: dict[str, Any]) -> Index:
    """The index in ``text``; ValueError saying what is wrong with it."""
    data = json.loads(text.decode("utf-8"))
    if not isinstance(data, dict) or not isinstance(data.get("tensors"), list):
        raise ValueError("not an object with a list of tensors")
    if data.get("iteration") != meta["iteration"] or data.get("layout") != meta["layout"]:
        raise ValueError(f"it describes iteration {str(data.get('iteration'))[:20]} with layout "
                         f"{str(data.get('layout'))[:120]}, not this checkpoint")
    index: Index = {}
    for record in data["tensors"]:
        if not isinstance(record, dict) or set(record) != {"name", "kind", "chunks", *_LAYOUT}:
            raise ValueError(f"a tensor record {str(record)[:80]} lacks or adds keys")
        found = payload.description_problem({**record, "tp_rank": 0, "start": 0, "end": 0})
        if found is not None or not isinstance(record["chunks"], list):
            raise ValueError(f"the record of {str(record['name'])[:80]} is malformed "
                             f"({found or 'no list of chunks'})")
        entry = Entry(**{k: record[k] for k in _LAYOUT if k != "local_shape"},
                      local_shape=tuple(record["local_shape"]), pieces=[])
        for chunk in record["chunks"]:
            entry.pieces.append(_piece(record, chunk, meta["layout"]["world_size"]))
        if (record["name"], record["kind"]) in index:
            raise ValueError(f"{record['name']} ({record['kind']}) is listed twice")
        index[(record["name"], record["kind"])] = entry
    return index


def _piece(record: dict[str, Any], chunk: Any, world_size: int) -> Piece:
    if not (isinstance(chunk, list) and len(chunk) == 4 and isinstance(chunk[0], int)
            and not isinstance(chunk[0], bool) and 0 <= chunk[0] < world_size):
        raise ValueError(f"a chunk of {str(record['name'])[:80]} is {str(chunk)[:40]}, not "
                         "[rank, tp_rank, start, end]")
    rank, tp_rank, start, end = chunk
    found = payload.description_problem({**{k: record[k] for k in ("name", "kind", *_LAYOUT)},
                                         "tp_rank": tp_rank, "start": start, "end": end})
    if found is not None:
        raise ValueError(f"a chunk of {str(record['name'])[:80]}: {found}")
    return Piece(rank, tp_rank, start, end)
