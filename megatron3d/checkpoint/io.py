"""Checkpoint files on disk: written atomically, read back with every problem named.

    DIR/latest                      the iteration of the newest complete checkpoint
    DIR/iter_0000100/meta.json      run state, configuration, layout, format version
    DIR/iter_0000100/rank_00003.pt  the chunks and RNG states one rank wrote

A checkpoint is first written to ``iter_0000100.SERIES.tmp/`` (its run's series, so that a
save's cleanup removes only its own), renamed when every rank's file is in
place, and only then does ``latest`` (written to a temporary name and renamed) point at it. A
process killed at any moment therefore leaves ``latest`` naming a complete checkpoint. The
directory must be shared by all nodes.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import pickle
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megatron3d.checkpoint import payload
from megatron3d.errors import CheckpointError

FORMAT_VERSION = 1
LATEST = "latest"
LEGACY_SERIES = ""  # the series of checkpoints written before meta.json named one
_INT64_MAX = 2**63 - 1
_ITERATION_DIGITS = 18  # more is past int64, and past any run (iterations stay below 2**32)
# Bounds of the small files a load reads whole, far above what any save writes (``latest``
# is one line; meta.json holds the config, a few KiB up to the longest --data-path lists).
LATEST_BYTES = 4096
META_BYTES = 1 << 24
# Rank files are read with torch's weights-only unpickler: tensors and plain Python data,
# never arbitrary classes, so loading cannot run code. Checkpoints written before the numpy
# RNG state was stored as plain data hold one uint32 numpy array; these let it through.
_LEGACY_NUMPY = [np.zeros(1, np.uint32).__reduce__()[0], np.ndarray, np.dtype,
                 type(np.dtype(np.uint32))]


def iteration_dir(root: Path, iteration: int) -> Path:
    return root / f"iter_{iteration:07d}"


def staging_dir(root: Path, iteration: int, series: str = LEGACY_SERIES) -> Path:
    """Where ``series`` writes a checkpoint before ``publish`` renames it (the legacy series:
    ``iter_N.tmp``, also what the offline tools write)."""
    tag = f".{series}" if series else ""
    return root / f"{iteration_dir(root, iteration).name}{tag}.tmp"


def rank_file(directory: Path, rank: int) -> Path:
    return directory / f"rank_{rank:05d}.pt"


def _atomic_write(path: Path, write, sync: bool = True) -> None:
    """``write(f)`` into a temporary file renamed to ``path``; ``sync``: flushed to the disk
    first (not for node-local copies a checksum guards: ``checkpoint/local``)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        if sync:
            os.fsync(f.fileno())
    os.replace(tmp, path)


def serialize_rank(payload: dict[str, Any], f) -> None:
    """A rank file's bytes into the open binary file ``f``."""
    try:
        torch.save(payload, f)
    except RuntimeError as err:  # torch's zip writer reports a failed write (a full disk)
        raise OSError(f"torch.save failed: {str(err).splitlines()[0]}") from None


def write_rank(directory: Path, rank: int, payload: dict[str, Any], sync: bool = True) -> None:
    _atomic_write(rank_file(directory, rank), lambda f: serialize_rank(payload, f), sync)


def write_meta(directory: Path, meta: dict[str, Any], sync: bool = True) -> None:
    text = json.dumps(meta, indent=1, sort_keys=True).encode()
    _atomic_write(directory / "meta.json", lambda f: f.write(text), sync)


def publish(root: Path, iteration: int, series: str = LEGACY_SERIES) -> None:
    """Make the finished ``.tmp`` directory the checkpoint and point ``latest`` at it."""
    os.replace(staging_dir(root, iteration, series), iteration_dir(root, iteration))
    _atomic_write(root / LATEST, lambda f: f.write(f"{iteration}\n".encode()))


@contextlib.contextmanager
def writing(root: Path) -> Iterator[None]:
    """Turn a failed write under ``root`` (a full disk, a path that changed since the start)
    into one ``CheckpointError`` line; what is already published is untouched."""
    try:
        yield
    except OSError as err:
        where = f" {err.filename}" if err.filename else ""
        raise CheckpointError(f"cannot write the checkpoint under {root} ({err.strerror or err}"
                              f"{where}): free space or fix the path, then resume with --load "
                              f"{root}; the checkpoints already saved there are kept") from None


def series_of(meta: dict[str, Any]) -> str:
    return meta.get("series", LEGACY_SERIES)


def prune(root: Path, keep_last: int, series: str) -> None:
    """Keep the newest ``keep_last`` (>= 1) checkpoints of ``series`` up to the one ``latest``
    names; delete the older ones of that series. Called only after ``publish``, so ``latest``
    is the newest known-good one and always stays; directories past it (an unpublished save,
    a resumed run's abandoned future) and other series' checkpoints (or unreadable ones) are
    left for the user. Ordered by iteration, not by name."""
    latest = read_latest(root)
    done = sorted((int(p.name[len("iter_"):]), p) for p in root.glob("iter_*")
                  if p.name[len("iter_"):].isdigit())
    ours = [p for it, p in done if it <= latest and _in_series(p, series)]
    for old in ours[:-keep_last]:  # latest is the last
        shutil.rmtree(old)


def _in_series(directory: Path, series: str) -> bool:
    try:
        return series_of(read_meta(directory)) == series
    except CheckpointError:
        return False


def read_small(path: Path, limit: int) -> bytes:
    """The bytes of the small metadata file ``path`` (at most ``limit``), for every such read
    of a checkpoint: a FIFO or device (a ``latest`` symlinked to one) would block or never
    end, and a huge file would fill memory, so both are a ``CheckpointError`` naming the
    file. Opened without blocking, then checked on the open file, which cannot change kind
    between the check and the read. Other ``OSError``s are the caller's to word."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        kind = os.fstat(fd).st_mode
        if stat.S_ISDIR(kind):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        if not stat.S_ISREG(kind):
            raise CheckpointError(f"{path} is not a regular file (a FIFO, device or socket): "
                                  "a checkpoint writes plain files; replace it with the file "
                                  "itself, or --load another directory")
        data = f.read(limit + 1)
    if len(data) > limit:
        size = os.stat(path).st_size
        raise CheckpointError(f"{path} is {size} bytes, more than any save writes ({limit}): "
                              "it is not this file or it is damaged; load an earlier "
                              "checkpoint or --load another directory")
    return data


def read_latest(root: Path) -> int:
    path = root / LATEST
    if not path.exists():
        raise CheckpointError(f"{root} holds checkpoints but no '{LATEST}' file naming the "
                              "complete one: write the iteration to load into it, or --load "
                              "another directory")
    try:
        text = read_small(path, LATEST_BYTES).decode("ascii").strip()
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} cannot be read as an iteration number "
                              f"({type(err).__name__}); it is damaged: write the iteration "
                              "to load into it, or --load another directory") from None
    iteration = parse_iteration(text)
    if iteration is None:
        raise CheckpointError(f"{path} should hold an iteration number, found {text[:40]!r}: "
                              "write the iteration to load into it, or --load another "
                              "directory")
    return iteration


def parse_iteration(text: str) -> int | None:
    """``text`` as an iteration number, or None unless it is ASCII digits of an int64 (str's
    ``isdigit`` also takes '²', which ``int`` refuses, and ``int`` refuses 4301+ digits)."""
    if not (text.isascii() and text.isdigit()) or len(text.lstrip("0")) > _ITERATION_DIGITS:
        return None
    return int(text)


def has_checkpoints(root: Path) -> bool:
    """False when there is no complete or published checkpoint: a missing or empty directory,
    or only the ``.tmp`` leftovers of a first save that was killed (a first run, or its
    requeue, starts from scratch)."""
    if not root.is_dir():
        return False
    return (root / LATEST).exists() or any(
        p.name.startswith("iter_") and not p.name.endswith(".tmp") for p in root.iterdir())


def clear_for_save(root: Path, iteration: int, series: str = LEGACY_SERIES) -> None:
    """Remove what killed saves of ``series`` left (its ``.tmp`` directories, and the legacy
    unnamed ones) and an ``iter_`` directory of this iteration that ``latest`` does not name
    (renamed, but its save never published). Another series' staging is never touched."""
    root.mkdir(parents=True, exist_ok=True)
    for tmp in root.glob("iter_*.tmp"):
        tag = tmp.name[:-len(".tmp")].partition(".")[2]
        if tag in (series, LEGACY_SERIES):
            shutil.rmtree(tmp)
    final = iteration_dir(root, iteration)
    if final.exists():
        shutil.rmtree(final)


def is_published(root: Path, iteration: int, series: str) -> bool:
    """Whether ``latest`` already names this iteration of ``series`` (saved twice at one
    step). Another series' checkpoint of that number (``--new-series``) is not ours: it is
    replaced."""
    return ((root / LATEST).exists() and read_latest(root) == iteration
            and _in_series(iteration_dir(root, iteration), series))


def read_meta(directory: Path) -> dict[str, Any]:
    path = directory / "meta.json"
    if not path.exists():
        raise CheckpointError(f"{path} is missing: {directory} is not a complete checkpoint")
    try:
        meta = json.loads(read_small(path, META_BYTES).decode("utf-8"))
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path} is not valid JSON ({err.msg}); the file is "
                              "damaged: load an earlier checkpoint") from None
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} cannot be read ({type(err).__name__}); the file is "
                              "damaged: load an earlier checkpoint") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path} holds a JSON {type(meta).__name__}, not an object; "
                              "the file is damaged: load an earlier checkpoint")
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path} has format version {meta.get('format_version')}, this "
                              f"megatron3d reads version {FORMAT_VERSION}")
    wrong = _wrong_fields(meta)
    if wrong:
        raise CheckpointError(f"{path} has missing or mistyped fields ({', '.join(wrong)}); "
                              "the file is damaged: load an earlier checkpoint")
    impossible = _impossible_values(meta)
    if impossible:
        raise CheckpointError(f"{path} holds values no run saves ({', '.join(impossible)}); "
                              "the file is damaged: load an earlier checkpoint")
    return meta


# What read_meta's callers use, with the types json gives them.
_META_FIELDS: dict[str, tuple[type, ...]] = {
    "iteration": (int,), "consumed_samples": (int,), "consumed_tokens": (int,),
    "adam_step": (int, float), "layout": (dict,), "loss_scaler": (dict, type(None)),
    "config": (dict,)}
_LAYOUT_FIELDS = ("world_size", "tp", "pp", "dp", "zero_stage")


def _wrong_fields(meta: dict[str, Any]) -> list[str]:
    """Names of the fields of ``meta`` that are missing or of the wrong type."""
    def ok(value: Any, types: tuple[type, ...]) -> bool:
        return isinstance(value, types) and not isinstance(value, bool)

    wrong = [k for k, types in _META_FIELDS.items() if not ok(meta.get(k), types)]
    if "layout" not in wrong:
        wrong += [f"layout.{k}" for k in _LAYOUT_FIELDS if not ok(meta["layout"].get(k), (int,))]
    if "config" not in wrong:
        wrong += [f"config.{k}" for k, v in meta["config"].items() if not ok(v, (dict,))]
        wrong += [] if "model" in meta["config"] else ["config.model"]
    if not isinstance(meta.get("series", LEGACY_SERIES), str):  # optional: older checkpoints
        wrong.append("series")
    return wrong + [k for k, ok in _RERUN_FIELDS.items() if k in meta and not ok(meta[k])]


def _skipped_batches(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(b, dict) and set(b) == {"iteration", "first_sample", "samples"}
        and all(type(n) is int and n >= 0 for n in b.values()) for b in value)


def _recent_losses(value: Any) -> bool:
    return isinstance(value, list) and all(
        type(x) in (int, float) and math.isfinite(x) for x in value)


# --rerun-on-bad-step's record (Progress): optional, older checkpoints lack it.
_RERUN_FIELDS = {"skipped_batches": _skipped_batches, "recent_losses": _recent_losses}


def _impossible_values(meta: dict[str, Any]) -> list[str]:
    """``name=value`` of the well-typed fields whose values no run writes: negative or
    past-int64 counters (training would stop with a traceback), a non-finite Adam step, a
    layout that is no layout."""
    def shown(name: str, value: Any) -> str:
        return f"{name}={str(value)[:24]}"

    bad = [shown(k, meta[k]) for k in ("iteration", "consumed_samples", "consumed_tokens")
           if not 0 <= meta[k] <= _INT64_MAX]
    step = meta["adam_step"]
    if not (math.isfinite(step) and 0 <= step <= _INT64_MAX):
        bad.append(shown("adam_step", step))
    layout = meta["layout"]
    bad += [shown(f"layout.{k}", layout[k]) for k in _LAYOUT_FIELDS
            if not (0 if k == "zero_stage" else 1) <= layout[k] <= _INT64_MAX]
    return bad


_FOREIGN = "Unsupported global: GLOBAL "  # how torch names a class it refused to unpickle


def _unreadable(path: Path, err: Exception) -> CheckpointError:
    first = (str(err).splitlines() or [""])[0][:160]
    return CheckpointError(f"{path} cannot be read ({type(err).__name__}: {first}); it is "
                           "truncated or damaged, load an earlier checkpoint")


def read_rank(directory: Path, rank: int) -> dict[str, Any]:
    path = rank_file(directory, rank)
    if not path.exists():
        raise CheckpointError(f"{path} is missing: the checkpoint was saved by more ranks than "
                              "left files; load an earlier checkpoint")
    try:
        with torch.serialization.safe_globals(_LEGACY_NUMPY):
            loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as err:
        if _FOREIGN not in str(err):
            raise _unreadable(path, err) from None
        found = str(err).split(_FOREIGN)[-1].split(" ")[0]
        raise CheckpointError(f"{path} holds an object other than tensors and plain data "
                              f"({found[:80]}), and unpickling it could run code, so it is not "
                              "loaded: this is not a megatron3d checkpoint or it was altered; "
                              "load a checkpoint from a trusted source") from None
    except Exception as err:  # torch's unpickler trips over damaged bytes in many ways
        raise _unreadable(path, err) from None
    found = payload.problem(loaded)
    if found is not None:
        raise CheckpointError(f"{path} {found}: the file is damaged, load an earlier "
                              "checkpoint")
    return loaded
