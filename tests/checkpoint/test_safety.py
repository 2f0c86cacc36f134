"""Checkpoint safety rules: a bad --save or --load, a save that would overwrite another run's
series, a rank file from another checkpoint and damaged metadata each stop the run with exit
code 2 and one line naming the fix, and every file already on disk stays byte-identical."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import pretrain_gpt
from tests.checkpoint.test_bad_checkpoints import _tree
from tests.helpers.launch import launch
from tests.helpers.tiny import train_argv


@pytest.fixture(scope="module")
def series(tmp_path_factory) -> Path:
    """Checkpoints at iterations 1, 2 and 3 of a run of 4; ``latest`` names 3."""
    root = tmp_path_factory.mktemp("series") / "run"
    assert pretrain_gpt.main(train_argv("gpt2", 4, "--save", str(root),
                                        "--save-interval", "1", "--exit-interval", "3")) == 0
    assert (root / "latest").read_text().strip() == "3"
    return root


@pytest.fixture
def copy(series, tmp_path) -> Path:
    root = tmp_path / "copy"
    shutil.copytree(series, root)
    return root


def _refused(argv: list[str], capsys, expected: str, *trees: Path) -> None:
    """``argv`` exits 2 with one ``error:`` line holding ``expected``; ``trees`` unchanged."""
    before = [_tree(t) for t in trees]
    assert pretrain_gpt.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and expected in err, err
    assert [_tree(t) for t in trees] == before


# 1. --save must be a writable directory.

def _a_file(tmp_path: Path, monkeypatch) -> Path:
    (tmp_path / "ckpt").write_text("notes\n")
    return tmp_path / "ckpt"


def _under_a_file(tmp_path: Path, monkeypatch) -> Path:
    (tmp_path / "notes").write_text("notes\n")
    return tmp_path / "notes" / "ckpt"


def _read_only(tmp_path: Path, monkeypatch) -> Path:
    directory = tmp_path / "ckpt"
    directory.mkdir()
    directory.chmod(0o555)
    if os.geteuid() == 0:  # root writes anywhere: answer as the kernel does for a user
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode, **kw:
                            Path(p) != directory and real(p, mode, **kw))
    return directory


def _under_read_only(tmp_path: Path, monkeypatch) -> Path:
    return _read_only(tmp_path, monkeypatch) / "run"


@pytest.mark.parametrize(("where", "expected"), [
    (_a_file, "--save must be a directory, but it is a file"),
    (_under_a_file, "--save must be a directory, but it is under the file"),
    (_read_only, "--save is not writable"),
    (_under_read_only, "--save cannot be created in"),
], ids=["file", "under a file", "read-only", "under read-only"])
def test_save_must_be_a_writable_directory(tmp_path, monkeypatch, capsys, where, expected):
    save = where(tmp_path, monkeypatch)
    listing = sorted(tmp_path.rglob("*"))
    _refused(train_argv("gpt2", 3, "--save", str(save)), capsys, expected, tmp_path)
    assert sorted(tmp_path.rglob("*")) == listing  # nothing created either


# 2. A series is continued only by the run that resumes from it.

@pytest.mark.parametrize(("extra", "expected"), [
    ((), "this run does not resume from them"),
    (("--load", "{other}"), "this run does not resume from them"),
    (("--finetune", "--load", "{copy}"), "--finetune restarts at iteration 0"),
], ids=["no --load", "--load elsewhere", "--finetune from it"])
def test_saving_over_another_series_is_refused(copy, tmp_path, capsys, extra, expected):
    """E.g. a requeued job that forgot --load would rewrite iter_0000001 and rewind latest."""
    other = tmp_path / "empty"
    argv = [a.format(other=other, copy=copy) for a in extra]
    _refused(train_argv("gpt2", 3, "--save", str(copy), *argv), capsys, expected, copy)


def test_refusal_names_the_fix(copy, capsys):
    _refused(train_argv("gpt2", 3, "--save", str(copy)), capsys,
             f"({copy}): pass --load {copy} to resume, choose an empty --save directory, or "
             "add --new-series to start a new series beside them", copy)


def _meta(root: Path, iteration: int) -> dict:
    return json.loads((root / f"iter_{iteration:07d}" / "meta.json").read_text())


def test_a_new_series_never_prunes_the_old_one(copy):
    """--new-series into a directory holding series A (1, 2, 3): the new run saves at 2 and 4
    with --keep-last-n 1; it replaces A's 2, prunes only its own 2, and A's 1 and 3 stay
    byte-identical although they are older than its latest."""
    old = {it: _tree(copy / f"iter_{it:07d}") for it in (1, 3)}
    series_a = _meta(copy, 3)["series"]
    assert pretrain_gpt.main(train_argv("gpt2", 4, "--save", str(copy), "--new-series",
                                        "--save-interval", "2", "--keep-last-n", "1")) == 0
    assert (copy / "latest").read_text().strip() == "4"
    assert sorted(p.name for p in copy.glob("iter_*")) == [
        "iter_0000001", "iter_0000003", "iter_0000004"]
    assert {it: _tree(copy / f"iter_{it:07d}") for it in (1, 3)} == old
    new = _meta(copy, 4)["series"]
    assert new and new != series_a and _meta(copy, 1)["series"] == series_a


def test_a_new_series_saving_at_the_old_latest_iteration_is_saved(copy):
    """The old series' latest is iteration 3; a new series ending at 3 must write its own
    checkpoint there, not take the old one for its own and save nothing."""
    series_a = _meta(copy, 3)["series"]
    before = _tree(copy / "iter_0000003")
    assert pretrain_gpt.main(train_argv("gpt2", 3, "--save", str(copy), "--new-series")) == 0
    assert _meta(copy, 3)["series"] not in ("", series_a)
    assert _tree(copy / "iter_0000003") != before


def test_a_resumed_run_prunes_its_own_series_including_older_checkpoints(copy):
    """Resuming continues the loaded series (checkpoints without a series name are one
    series of their own), so --keep-last-n prunes the checkpoints it continues."""
    for it in (1, 2, 3):
        path = copy / f"iter_{it:07d}" / "meta.json"
        meta = json.loads(path.read_text())
        del meta["series"]  # as written before checkpoints named their series
        path.write_text(json.dumps(meta))
    assert pretrain_gpt.main(train_argv("gpt2", 4, "--load", str(copy), "--save", str(copy),
                                        "--keep-last-n", "2")) == 0
    assert sorted(p.name for p in copy.glob("iter_*")) == ["iter_0000003", "iter_0000004"]
    assert _meta(copy, 4)["series"] == ""  # the unnamed legacy series goes on


def test_resume_and_finetune_into_an_empty_directory_still_save(copy, tmp_path):
    """--load DIR --save DIR (the same directory spelled differently) resumes and continues
    the series; --finetune --load A --save B with B empty starts B's own series."""
    spelled = copy.parent / ".." / copy.parent.name / copy.name
    assert pretrain_gpt.main(train_argv("gpt2", 4, "--load", str(spelled),
                                        "--save", str(copy))) == 0
    assert (copy / "latest").read_text().strip() == "4"
    before = _tree(copy)
    fresh = tmp_path / "finetuned"
    assert pretrain_gpt.main(train_argv("gpt2", 3, "--finetune", "--load", str(copy),
                                        "--save", str(fresh))) == 0
    assert (fresh / "latest").read_text().strip() == "3"
    assert _tree(copy) == before


# 3. --load takes the checkpoint root.

@pytest.mark.parametrize("inside", ["iter_0000002", "iter_0000002/meta.json",
                                    "iter_0000002/rank_00000.pt", "latest"])
def test_load_of_a_checkpoint_or_a_file_names_the_root(copy, capsys, inside):
    what = "a file" if "." in inside or inside == "latest" else "one checkpoint"
    _refused(train_argv("gpt2", 4, "--load", str(copy / inside)), capsys,
             f"not {what} ({copy / inside}): pass --load {copy}", copy)


# 4. Each rank file must be this checkpoint's own.

def test_a_rank_file_holding_nan_is_refused(copy, capsys):
    path = copy / "iter_0000003" / "rank_00000.pt"
    payload = torch.load(path, weights_only=True)
    payload["chunks"][0]["data"][0] = float("nan")
    torch.save(payload, path)
    _refused(train_argv("gpt2", 4, "--load", str(copy)), capsys, "holds NaN or Inf in", copy)


def test_a_rank_file_from_another_iteration_is_refused(copy, capsys):
    shutil.copy(copy / "iter_0000002" / "rank_00000.pt", copy / "iter_0000003")
    _refused(train_argv("gpt2", 4, "--load", str(copy)), capsys,
             "rank_00000.pt belongs to another checkpoint (iteration 2, meta.json says 3)",
             copy)


@pytest.mark.parametrize(("key", "value", "named"), [
    ("rank", 1, "(rank 1, meta.json says 0)"),
    ("layout", {"world_size": 2, "tp": 2, "pp": 1, "dp": 1, "zero_stage": 0}, "(layout {"),
])
def test_a_rank_file_of_another_rank_or_layout_is_refused(copy, capsys, key, value, named):
    path = copy / "iter_0000003" / "rank_00000.pt"
    payload = torch.load(path, weights_only=True)
    torch.save({**payload, key: value}, path)
    _refused(train_argv("gpt2", 4, "--load", str(copy)), capsys,
             f"rank_00000.pt belongs to another checkpoint {named}", copy)


def test_rank_files_without_their_iteration_still_load(copy):
    """Files written before rank files carried their iteration, rank and layout."""
    path = copy / "iter_0000003" / "rank_00000.pt"
    payload = torch.load(path, weights_only=True)
    assert payload.keys() == {"chunks", "rng", "iteration", "rank", "layout"}
    torch.save({"chunks": payload["chunks"], "rng": payload["rng"]}, path)
    assert pretrain_gpt.main(train_argv("gpt2", 4, "--load", str(copy))) == 0


# 5. Damaged metadata is one line, not a traceback.

def _edit_meta(change: Callable[[dict], object]) -> Callable[[Path], None]:
    def damage(root: Path) -> None:
        path = root / "iter_0000003" / "meta.json"
        path.write_text(json.dumps(change(json.loads(path.read_text()))))
    return damage


def _latest_directory(root: Path) -> None:
    (root / "latest").unlink()
    (root / "latest").mkdir()
    (root / "latest" / "3").write_text("3\n")


@pytest.mark.parametrize(("damage", "expected"), [
    (lambda r: (r / "latest").write_text("three\n"), "should hold an iteration number, "
                                                     "found 'three'"),
    (lambda r: (r / "latest").write_bytes(b"\xff\xfe3\n"), "(UnicodeDecodeError)"),
    (_latest_directory, "(IsADirectoryError)"),
    (lambda r: (r / "iter_0000003" / "meta.json").write_bytes(b'{"a": "\xff"}'),
     "meta.json cannot be read (UnicodeDecodeError)"),
    (_edit_meta(lambda m: [m]), "holds a JSON list, not an object"),
    (_edit_meta(lambda m: {k: v for k, v in m.items() if k != "iteration"}),
     "missing or mistyped fields (iteration)"),
    (_edit_meta(lambda m: {**m, "layout": {**m["layout"], "tp": "1"}, "config": []}),
     "missing or mistyped fields (config, layout.tp)"),
    (_edit_meta(lambda m: {**m, "config": {**m["config"], "model": 1}}),
     "missing or mistyped fields (config.model)"),
], ids=["latest not digits", "latest not utf-8", "latest a directory", "meta not utf-8",
        "meta a list", "meta without iteration", "meta of wrong types", "meta model not dict"])
def test_damaged_metadata_fails_with_one_line(copy, capsys, damage, expected):
    damage(copy)
    _refused(train_argv("gpt2", 4, "--load", str(copy)), capsys, expected, copy)


# Every rank stops, before joining the process group.

def test_every_rank_of_a_job_stops_with_one_line(copy, tmp_path):
    before = _tree(copy)
    job = launch("pretrain_gpt.py", train_argv("gpt2", 3, "--save", str(copy)), 2, tmp_path)
    try:
        assert job.wait(timeout_s=60, teardown_s=30) == 2
    finally:
        job.kill()
    for rank in range(2):
        lines = job.output(rank).splitlines()
        assert [ln for ln in lines if ln.startswith("error: ")] == lines, lines
        assert len(lines) == 1 and "already holds checkpoints" in lines[0], lines
    assert _tree(copy) == before
