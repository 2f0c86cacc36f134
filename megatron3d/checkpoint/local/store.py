"""Where a rank keeps its non-persistent checkpoints, and the copies found there.

    ROOT/megatron3d-KEY/rank<r>/own/iter_0000012/        rank r's state at iteration 12
    ROOT/megatron3d-KEY/rank<r>/held/rank<o>/iter_0000012/   rank o's state, replicated to r

Each copy is a loadable checkpoint directory for its owner: ``meta.json`` and the owner's
rank file, exactly as a global save writes them, plus ``local.json`` (owner, iteration,
the configuration hash and a CRC-32 of meta.json: the rank file, a zip archive, holds one
per record), and ``confirmed`` once every rank held its state of that iteration (the save's
last barrier). A copy is written under ``iter_N.tmp`` and renamed when complete, so a
killed writer leaves no half copy that looks whole; a save renames the oldest copy it
replaces to that name and overwrites its files in place (``reuse``, ``pages.py``: no pages
freed and allocated again at every save). KEY is ``$TORCHELASTIC_RUN_ID`` (torchrun keeps
it across restarts of its workers), else ``$SLURM_JOB_ID`` (a requeue keeps it), else
``local``. ROOT is the node-local
``--non-persistent-local-ckpt-dir``, or /dev/shm (host memory) for ``memory``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import zipfile
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path

from megatron3d.checkpoint import io
from megatron3d.config import CheckpointConfig

SIDECAR, CONFIRMED = "local.json", "confirmed"
KEEP = 2  # complete iterations kept per owner: the newest may be the one being replaced
_MEMORY_ROOT = "/dev/shm"


def store_root(ckpt: CheckpointConfig, env: dict[str, str] | None = None) -> Path:
    """This job's store, the same path after an in-job restart or a requeue."""
    env = os.environ if env is None else env
    key = env.get("TORCHELASTIC_RUN_ID") or env.get("SLURM_JOB_ID") or "local"
    base = ckpt.non_persistent_local_ckpt_dir or _MEMORY_ROOT
    return Path(base) / f"megatron3d-{key}"


def rank_dir(root: Path, rank: int) -> Path:
    return root / f"rank{rank}"


def own_dir(root: Path, rank: int) -> Path:
    """Where rank ``rank`` writes its own states."""
    return rank_dir(root, rank) / "own"


def held_dir(root: Path, holder: int, owner: int) -> Path:
    """Where rank ``holder`` writes the replicas of ``owner``'s states."""
    return rank_dir(root, holder) / "held" / f"rank{owner}"


def checksum(data: bytes) -> int:
    return zlib.crc32(data)


@dataclass(frozen=True)
class Copy:
    """One complete copy of an owner's state, as listed (its bytes not yet checked)."""

    owner: int
    iteration: int
    config_hash: str
    confirmed: bool
    path: str


def write_copy(directory: Path, files: dict[str, bytes], sidecar: dict) -> None:
    """A copy made of ``files`` (name -> bytes) and its sidecar, published by a rename."""
    staging = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for name, data in files.items():
        (staging / name).write_bytes(data)
    finish_copy(staging, directory, sidecar, files)


def reuse(parent: Path, iteration: int) -> Path:
    """The staging directory of ``iteration``'s copy in ``parent``, holding the files of the
    copy the next ``prune`` would remove (the oldest of ``KEEP``), to be overwritten in
    place (``pages.py``); the newer copies stay whole. It is renamed out of the listing
    before its sidecar goes, so it is never seen complete with changed files."""
    staging = parent / f"{io.iteration_dir(parent, iteration).name}.tmp"
    found = _complete(parent)
    if not staging.exists() and len(found) >= KEEP and found[0][0] < iteration:
        os.replace(found[0][1], staging)
        for name in (SIDECAR, CONFIRMED):
            (staging / name).unlink(missing_ok=True)
    staging.mkdir(parents=True, exist_ok=True)
    return staging


def finish_copy(staging: Path, directory: Path, sidecar: dict, names: Iterable[str]) -> None:
    """Remove what else ``staging`` holds (a reused copy's leftovers), write the sidecar of
    its files ``names`` and rename it to ``directory``."""
    kept = set(names)
    for path in staging.iterdir():
        if path.name not in kept:
            path.unlink()
    (staging / SIDECAR).write_text(json.dumps(sidecar, sort_keys=True))
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(staging, directory)


def sidecar_of(owner: int, iteration: int, config_hash: str,
               files: dict[str, bytes]) -> dict:
    """The copy's description: whose state, which iteration and configuration, and a CRC-32
    of each file that has none of its own (a rank file is a zip archive in which
    ``torch.save`` already wrote a CRC-32 of every record: computing one more would read its
    bytes again at every save)."""
    return {"owner": owner, "iteration": iteration, "config_hash": config_hash,
            "crc32": {name: checksum(data) for name, data in files.items()
                      if not _zipped(name)}}


def _zipped(name: str) -> bool:
    return name.endswith(".pt")


def _zip_intact(data: bytes | memoryview) -> bool:
    """Whether every record of a rank file matches the CRC-32 its zip directory holds."""
    try:
        with zipfile.ZipFile(BytesIO(data)) as archive:
            return archive.testzip() is None
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError):
        return False


def read_files(directory: Path) -> dict[str, bytes]:
    """The files a copy carries (its sidecar and confirmation aside)."""
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())
            if p.name not in (SIDECAR, CONFIRMED)}


def read_sidecar(directory: Path) -> dict:
    return json.loads((directory / SIDECAR).read_text())


def is_own(path: str, owner: int) -> bool:
    """Whether the copy at ``path`` is in ``owner``'s own directory (not a replica)."""
    parent = Path(path).parent
    return parent.name == "own" and parent.parent.name == f"rank{owner}"


def intact(directory: Path, config_hash: str) -> dict[str, bytes] | None:
    """The copy's files if every checksum matches its sidecar and the copy was made by this
    configuration, else None (a damaged or foreign copy is never used)."""
    try:
        sidecar = read_sidecar(directory)
        files = read_files(directory)
    except (OSError, ValueError):
        return None
    expected = sidecar.get("crc32", {})
    good = (sidecar.get("config_hash") == config_hash
            and {n for n in files if not _zipped(n)} == expected.keys()
            and all(_zip_intact(data) if _zipped(name) else checksum(data) == expected[name]
                    for name, data in files.items()))
    return files if good else None


def listed(root: Path, only: int | None = None) -> list[Copy]:
    """Every complete copy visible under ``root`` (on one machine: every rank's), or only in
    rank ``only``'s directory."""
    return sorted(_copies(root, only), key=lambda c: (c.owner, c.iteration, c.path))


def _copies(root: Path, only: int | None) -> Iterator[Copy]:
    if not root.is_dir():
        return
    for ranks in root.glob("rank*") if only is None else [rank_dir(root, only)]:
        parents = [ranks / "own", *(ranks / "held").glob("rank*")]
        for directory in (d for p in parents if p.is_dir() for d in p.glob("iter_*")):
            if directory.name.endswith(".tmp"):
                continue
            try:
                sidecar = read_sidecar(directory)
                yield Copy(int(sidecar["owner"]), int(sidecar["iteration"]),
                           str(sidecar["config_hash"]), (directory / CONFIRMED).exists(),
                           str(directory))
            except (OSError, ValueError, KeyError, TypeError):
                continue  # unreadable: not a copy


def confirm(directory: Path) -> None:
    (directory / CONFIRMED).touch()


def prune(parent: Path) -> None:
    """Keep the newest ``KEEP`` copies in ``parent``; remove older ones and leftovers."""
    found = _complete(parent)
    for _, old in found[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)
    newest = found[-1][0] if found else -1
    for tmp in parent.glob("iter_*.tmp"):
        if _iteration(tmp.name.removesuffix(".tmp")) < newest:
            shutil.rmtree(tmp, ignore_errors=True)


def _complete(parent: Path) -> list[tuple[int, Path]]:
    """The published copies in ``parent``, oldest first."""
    return sorted((_iteration(p.name), p) for p in parent.glob("iter_*")
                  if not p.name.endswith(".tmp"))


def _iteration(name: str) -> int:
    return int(name[len("iter_"):])


def copy_dir(root: Path, rank: int, iteration: int) -> Path:
    """Rank ``rank``'s own copy of ``iteration``: what a load of its state reads."""
    return io.iteration_dir(own_dir(root, rank), iteration)


def frames(files: dict[str, bytes | memoryview], sidecar: dict) -> list[memoryview]:
    """A copy's wire form: a JSON header (file names, sidecar), then each file's bytes as
    they are (views, not copies: a save's rank file goes from the one buffer it was
    serialised into). Plain data only: nothing received is unpickled."""
    header = bytearray(json.dumps({"names": list(files), "sidecar": sidecar}).encode())
    return [memoryview(header), *(memoryview(data) for data in files.values())]


def unframe(parts: list[memoryview]) -> tuple[dict[str, memoryview], dict]:
    """``frames``' files (views into ``parts``) and sidecar back."""
    header = json.loads(bytes(parts[0]))
    return dict(zip(header["names"], parts[1:], strict=True)), header["sidecar"]


def described(header: memoryview) -> tuple[list[str], dict]:
    """The file names and sidecar a ``frames`` header announces (each name a plain name,
    never a path)."""
    found = json.loads(bytes(header))
    names = found["names"]
    if not all(isinstance(n, str) and n and Path(n).name == n and n not in (".", "..")
               for n in names):
        raise ValueError(f"a copy's file names must be plain names, not {names}")
    return names, found["sidecar"]


def config_hash(config: dict, layout: dict) -> str:
    """What a copy must have been made by to be restored: the run's model, data, training,
    optimizer and parallel settings and its layout (not how it is operated: checkpoint,
    resilience and logging flags may change across a restart)."""
    kept = {k: v for k, v in config.items() if k not in ("checkpoint", "resilience", "logging")}
    text = json.dumps({"config": kept, "layout": layout}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
