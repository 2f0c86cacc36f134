"""Checks that keep a run from losing or mixing up checkpoints, made before any work.

At start, every rank checks ``--save`` and ``--load``, so a bad path stops the run with one
line instead of failing at the first save, hours in. A ``--save`` directory must be
writable, and one that already holds a series must be the one this run resumes from: a
requeued job that forgot ``--load`` would otherwise rewrite ``iter_0000001`` and rewind
``latest`` (``--new-series`` says that is meant: a new series starts beside the old one,
whose checkpoints ``--keep-last-n`` never prunes). ``--load`` takes the checkpoint root; an
iteration directory or a file there would otherwise look empty and silently start from
scratch; the checkpoint it names must have every rank file its ranks saved, checked by
every rank before any collective (a rank that failed alone inside the load would leave the
others waiting). At load, each rank file must belong to the checkpoint its ``meta.json``
describes (a file copied in from another iteration or layout would install wrong state).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from megatron3d.checkpoint import io
from megatron3d.config import CheckpointConfig
from megatron3d.errors import CheckpointError, ConfigError


def check_paths(cfg: CheckpointConfig, skip_train: bool = False) -> None:
    """Check ``--load`` and ``--save``, reading only. Called on every rank before the process
    group exists (the hang dumps go under ``--save`` from then on); the directory is shared
    by all nodes, so every rank reaches the same verdict."""
    if cfg.load:
        check_load_root(Path(cfg.load))
        strict = [name for name, on in (("--finetune", cfg.finetune),
                                        ("--use-checkpoint-args", cfg.use_checkpoint_args),
                                        ("--skip-train", skip_train),
                                        ("--exit-on-missing-checkpoint",
                                         cfg.exit_on_missing_checkpoint)) if on]
        if strict:  # a plain --load may find nothing: it starts from scratch
            require_checkpoint(cfg.load, strict[0])
        check_loadable(Path(cfg.load))
    if cfg.save:
        check_save_dir(Path(cfg.save))
        if not cfg.new_series:
            check_series(Path(cfg.save), cfg.load, cfg.finetune)


def check_load_root(root: Path) -> None:
    """``--load`` names the directory holding ``latest``, never one checkpoint or a file."""
    if root.is_file():
        what = "a file"
    elif root.is_dir() and not (root / io.LATEST).exists() and (
            (root / "meta.json").exists() or any(root.glob("rank_*.pt"))):
        what = "one checkpoint"
    else:
        return
    hint = next((p for p in root.parents if (p / io.LATEST).is_file()), root.parent)
    raise ConfigError(f"--load takes the checkpoint root, the directory holding "
                      f"'{io.LATEST}', not {what} ({root}): pass --load {hint}")


def check_loadable(root: Path, rank: int | None = None) -> None:
    """The checkpoint a load would read is whole on disk: ``latest``, its ``meta.json`` and
    every rank file its layout names. Rank 0 stats each file (a regular file with bytes);
    the others read one directory listing and stat only their own file, so a 384-rank start
    costs the shared file system one listing per rank, not ranks x files stats. A rank that
    finds nothing wrong goes on to the rendezvous, where the launcher stops it when the rank
    that found the problem exits: no rank enters the load's collectives with a file missing.
    ``rank`` defaults to the launcher's ``RANK``."""
    if not io.has_checkpoints(root):
        return
    directory = io.iteration_dir(root, io.read_latest(root))
    saved_by = io.read_meta(directory)["layout"]["world_size"]
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    listed = None if rank == 0 else {entry.name for entry in os.scandir(directory)}
    for saved_rank in range(saved_by):  # stops at the first problem: the count may be damaged
        path = io.rank_file(directory, saved_rank)
        if listed is None or saved_rank == rank:
            problem = _file_problem(path)
        else:
            problem = None if path.name in listed else "is missing"
        if problem is not None:
            raise CheckpointError(f"{path} {problem}, and the checkpoint needs all {saved_by} "
                                  "rank files its ranks saved: restore it or load an earlier "
                                  "checkpoint")


def _file_problem(path: Path) -> str | None:
    """What keeps ``path`` from being read as a rank file, without opening it."""
    try:
        found = path.stat()
    except FileNotFoundError:
        return "is missing"
    except OSError as err:
        return f"cannot be read ({err.strerror})"
    if not stat.S_ISREG(found.st_mode):
        return "is not a regular file"
    if found.st_size == 0:
        return "is empty"
    if not os.access(path, os.R_OK):
        return "cannot be read (permission denied)"
    return None


def require_checkpoint(load: str, needed_by: str) -> None:
    """``needed_by`` (--finetune, --use-checkpoint-args, --skip-train) has nothing to do
    without a checkpoint, so unlike a plain ``--load`` it may not start from scratch."""
    root = Path(load)
    if io.has_checkpoints(root):
        return
    why = "holds no checkpoint" if root.is_dir() else "does not exist"
    raise ConfigError(f"{needed_by} needs a checkpoint to load, but the --load directory {why} "
                      f"({root}): point --load at the --save directory of a run that saved "
                      f"one, or drop {needed_by}")


def check_save_dir(root: Path) -> None:
    """``--save`` must be a writable directory, or creatable under a writable one."""
    check_output_dir(root, "--save")


def check_output_dir(root: Path, flag: str) -> None:
    """A directory the run writes into (``flag`` names it: --save, --tensorboard-dir,
    --hang-dump-dir) must be a writable directory, or creatable under a writable one; reads
    only, so a refused run leaves the disk as it was."""
    existing = next(p for p in (root, *root.parents) if p.exists())
    if not existing.is_dir():
        where = "is a file" if existing == root else f"is under the file {existing}"
        raise ConfigError(f"{flag} must be a directory, but it {where} ({root}): choose a "
                          "directory path")
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "is not writable" if existing == root else f"cannot be created in {existing}"
        raise ConfigError(f"{flag} {what} ({root}): fix its permissions or choose a "
                          "writable directory")


def check_series(save: Path, load: str | None, finetune: bool) -> None:
    """A ``--save`` directory that already holds checkpoints is written only by the run
    resuming from it (``--load`` the same directory, without ``--finetune``): anything else
    would restart the iteration count there and rewind ``latest``."""
    if not io.has_checkpoints(save):
        return
    same = bool(load) and Path(load).resolve() == save.resolve()
    if same and not finetune:
        return
    why = "--finetune restarts at iteration 0" if same else "this run does not resume from them"
    raise ConfigError(f"--save already holds checkpoints and {why} ({save}): pass --load "
                      f"{save} to resume, choose an empty --save directory, or add "
                      "--new-series to start a new series beside them")


def check_rank_file(directory: Path, rank: int, payload: Any, meta: dict[str, Any]) -> None:
    """A rank file must be this checkpoint's file of this rank. Files written before rank
    files carried their iteration, rank and layout are taken as they are."""
    path = io.rank_file(directory, rank)
    if not isinstance(payload, dict) or not {"chunks", "rng"} <= payload.keys():
        raise CheckpointError(f"{path} is not a megatron3d rank file (it holds "
                              f"{type(payload).__name__} without 'chunks' and 'rng'): load "
                              "an earlier checkpoint")
    expected = {"iteration": meta["iteration"], "rank": rank, "layout": meta["layout"]}
    for key, value in expected.items():
        if key in payload and payload[key] != value:
            raise CheckpointError(f"{path} belongs to another checkpoint ({key} "
                                  f"{payload[key]!r}, meta.json says {value!r}): restore this "
                                  "checkpoint's own rank files, or load an earlier checkpoint")
