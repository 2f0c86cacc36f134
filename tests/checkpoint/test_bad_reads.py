"""What --load reads before any work: every rank file the checkpoint needs is there, a
regular file with bytes, or one line names it before the process group exists; ``latest``,
``meta.json`` and ``index.json`` are read only when they are regular files of a bounded size
(a FIFO would block forever); ``--use-checkpoint-args`` names a mistyped saved value."""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

import pretrain_gpt
from megatron3d.checkpoint import io
from megatron3d.checkpoint.safety import check_loadable
from megatron3d.errors import CheckpointError
from tests.checkpoint.test_bad_checkpoints import _tree
from tests.helpers.tiny import train_argv

ITER = "iter_0000003"


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A run of 5 stopped at 3 (so a resume goes on), by one process."""
    root = tmp_path_factory.mktemp("ckpt") / "run"
    assert pretrain_gpt.main(train_argv("gpt2", 5, "--save", str(root), "--exit-interval",
                                        "3")) == 0
    return root


@pytest.fixture
def copy(saved, tmp_path) -> Path:
    root = tmp_path / "copy"
    shutil.copytree(saved, root)
    return root


def _no_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    def must_not_start(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("a bad checkpoint must be refused before the process group")

    monkeypatch.setattr(pretrain_gpt.devices, "init_process_group", must_not_start)


def _refused(argv: list[str], capsys, root: Path, *named: str) -> None:
    """Exit 2, one ``error:`` line naming ``named``, nothing under ``root`` changed or added
    (no hang dump either)."""
    before = _tree(root)
    listing = sorted(root.rglob("*"))
    assert pretrain_gpt.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert all(name in err for name in named), err
    assert _tree(root) == before and sorted(root.rglob("*")) == listing


def _saved_by_two_ranks(root: Path) -> None:
    """meta.json says two DP ranks saved the checkpoint: rank_00001.pt belongs to it."""
    path = root / ITER / "meta.json"
    meta = json.loads(path.read_text())
    meta["layout"].update(world_size=2, dp=2)
    path.write_text(json.dumps(meta))


def _missing(root: Path) -> str:
    _saved_by_two_ranks(root)
    return "rank_00001.pt is missing"


def _empty(root: Path) -> str:
    (root / ITER / "rank_00000.pt").write_bytes(b"")
    return "rank_00000.pt is empty"


def _a_directory(root: Path) -> str:
    (root / ITER / "rank_00000.pt").unlink()
    (root / ITER / "rank_00000.pt").mkdir()
    return "rank_00000.pt is not a regular file"


def _a_fifo(root: Path) -> str:
    (root / ITER / "rank_00000.pt").unlink()
    os.mkfifo(root / ITER / "rank_00000.pt")
    return "rank_00000.pt is not a regular file"


@pytest.mark.parametrize("damage", [_missing, _empty, _a_directory, _a_fifo],
                         ids=["missing", "empty", "directory", "fifo"])
def test_every_rank_file_is_checked_before_the_process_group(copy, capsys, monkeypatch,
                                                             damage):
    """Each rank checks them all: a rank whose own file is fine must not go on into the
    load's collectives while another rank fails (the healthy ranks used to crash there)."""
    named = damage(copy)
    _no_process_group(monkeypatch)
    _refused(train_argv("gpt2", 5, "--load", str(copy), "--save", str(copy)), capsys, copy,
             named, "restore it or load an earlier checkpoint")


def _fifo_at(path: Path) -> Path:
    """``path`` becomes a symlink to a FIFO nobody writes."""
    fifo = path.parent / (path.name + ".fifo")
    os.mkfifo(fifo)
    path.unlink()
    path.symlink_to(fifo)
    return fifo


def _in_a_thread(call: Callable[[], object], fifo: Path) -> None:
    """Run ``call``; if it is still blocked after a while, unblock it by writing into
    ``fifo`` (a reader blocked in open() lets a non-blocking writer open it), then fail."""
    done = threading.Event()
    thread = threading.Thread(target=lambda: (call(), done.set()), daemon=True)
    thread.start()
    thread.join(timeout=20)
    if thread.is_alive():
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.write(fd, b"3\n")
        os.close(fd)
        thread.join(timeout=20)
        pytest.fail(f"reading {fifo.name} blocked")
    assert done.is_set()


@pytest.mark.parametrize("name", ["latest", f"{ITER}/meta.json"])
def test_metadata_that_is_a_fifo_is_refused_without_blocking(copy, capsys, name):
    fifo = _fifo_at(copy / name)
    argv = train_argv("gpt2", 5, "--load", str(copy))
    _in_a_thread(lambda: _refused(argv, capsys, copy, "is not a regular file"), fifo)


@pytest.mark.parametrize(("name", "size"), [("latest", 4097), (f"{ITER}/meta.json", 2**24 + 1)])
def test_oversized_metadata_is_refused(copy, capsys, name, size):
    """Padding a valid file past its bound: refused by its size, never read whole."""
    path = copy / name
    text = path.read_bytes()
    path.write_bytes(text + b" " * (size - len(text)))
    _refused(train_argv("gpt2", 5, "--load", str(copy)), capsys, copy, "bytes, more than")


def test_read_small_refuses_what_it_cannot_bound(tmp_path):
    """The one helper every small checkpoint file goes through."""
    (tmp_path / "ok").write_bytes(b"12\n")
    assert io.read_small(tmp_path / "ok", 3) == b"12\n"
    with pytest.raises(CheckpointError, match=r"is 4 bytes, more than any save writes \(3\)"):
        (tmp_path / "big").write_bytes(b"123\n")
        io.read_small(tmp_path / "big", 3)
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(CheckpointError, match="not a regular file"):
        io.read_small(tmp_path / "fifo", 3)


def _model_field(root: Path, key: str, value: object) -> None:
    path = root / ITER / "meta.json"
    meta = json.loads(path.read_text())
    meta["config"]["model"][key] = value
    path.write_text(json.dumps(meta))


@pytest.mark.parametrize(("key", "value", "named"), [
    ("num_layers", "two", "--num-layers='two'"),
    ("hidden_size", [32], "--hidden-size=[32]"),
    ("swiglu", "yes", "--swiglu='yes'"),
], ids=["int as word", "int as list", "bool as string"])
def test_use_checkpoint_args_names_a_mistyped_saved_value(copy, capsys, monkeypatch, key,
                                                          value, named):
    _model_field(copy, key, value)
    _no_process_group(monkeypatch)
    argv = train_argv("gpt2", 5, "--load", str(copy), "--use-checkpoint-args")
    _refused(argv, capsys, copy, named, "meta.json", "drop --use-checkpoint-args")


def test_only_rank_0_stats_every_rank_file(copy):
    """The others list the directory once and stat their own file: a 384-rank start must not
    cost the shared file system ranks x files stats. A missing file stops every rank."""
    _saved_by_two_ranks(copy)
    (copy / ITER / "rank_00001.pt").write_bytes(b"")
    for rank in (0, 1):
        with pytest.raises(CheckpointError, match="rank_00001.pt is empty"):
            check_loadable(copy, rank)
    (copy / ITER / "rank_00001.pt").write_bytes(b"x")
    (copy / ITER / "rank_00000.pt").write_bytes(b"")
    check_loadable(copy, 1)  # rank 0's empty file is rank 0's to find
    with pytest.raises(CheckpointError, match="rank_00000.pt is empty"):
        check_loadable(copy, 0)
    (copy / ITER / "rank_00000.pt").write_bytes(b"x")
    _saved_by_three_ranks(copy)
    for rank in (0, 1, 2):
        with pytest.raises(CheckpointError, match="rank_00002.pt is missing"):
            check_loadable(copy, rank)


def _saved_by_three_ranks(root: Path) -> None:
    path = root / ITER / "meta.json"
    meta = json.loads(path.read_text())
    meta["layout"].update(world_size=3, dp=3)
    path.write_text(json.dumps(meta))
