"""Bad input that used to escape into a training run (issue #31, part E1): each is refused
(exit 2, one ``error:`` line) or stops the run (exit 0 or 1, one line) before anything is
written, instead of a traceback, a hang exit or a published dead state.

``pretrain_gpt.main`` runs in this process, one rank, as ``tests/test_pretrain_cli.py`` does.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import pytest
import torch

import pretrain_gpt
from megatron3d.checkpoint import io
from megatron3d.checkpoint.save_lock import SaveLock, _same_file
from megatron3d.cli.arguments import parse_args
from megatron3d.errors import TrainingError
from megatron3d.mpu.state import AxisGroup
from megatron3d.training.divergence import SkipWatch
from megatron3d.validation import validate
from tests.fuzz.common import assert_main_refuses, tree_digest
from tests.helpers.tiny import train_argv

ROOT = Path(__file__).resolve().parents[2]


def _must_not_start(*_args: object, **_kwargs: object) -> None:
    raise AssertionError("bad input must stop before the process group starts")


@pytest.fixture
def no_start(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """One rank, in ``tmp_path``; starting the process group fails the test."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(pretrain_gpt.devices, "init_process_group", _must_not_start)
    return tmp_path


@pytest.mark.parametrize("flag", ["--tensorboard-dir", "--hang-dump-dir"])
def test_an_output_directory_that_is_a_file_exits_2(no_start, capsys, flag):
    """Was a traceback (FileExistsError / NotADirectoryError on every rank) after start-up."""
    (no_start / "taken").write_text("mine")
    before = tree_digest(no_start)
    err = assert_main_refuses(pretrain_gpt.main(train_argv("gpt2", 3, flag, "taken")), capsys)
    assert flag in err and "taken" in err, err
    assert tree_digest(no_start) == before


def test_a_kill_switch_present_at_start_up_exits_at_once(no_start, capsys):
    """Was: loaded, trained a step and saved a checkpoint before stopping."""
    (no_start / "stop").touch()
    code = pretrain_gpt.main(train_argv("gpt2", 3, "--kill-switch-path", "stop",
                                        "--save", "ckpt"))
    out, err = capsys.readouterr()
    assert code == 0, err
    assert err == "" and out.count("\n") == 1 and "kill switch stop" in out, (out, err)
    assert sorted(p.name for p in no_start.iterdir()) == ["stop"]  # nothing saved


def test_a_second_writer_of_one_save_directory_is_refused(no_start, capsys):
    """Two runs saving into one --save both passed the series check while it was empty."""
    save = no_start / "ckpt"
    with SaveLock.take(save):  # the first run, holding --save for its life
        before = tree_digest(no_start)
        err = assert_main_refuses(pretrain_gpt.main(train_argv("gpt2", 3, "--save", "ckpt")),
                                  capsys)
        assert "--save is in use by pid" in err and "(ckpt)" in err, err
        assert tree_digest(no_start) == before
    with SaveLock.take(save):  # released: a crashed holder leaves no stale lock either
        pass


def test_a_save_clears_only_its_own_series_staging(tmp_path):
    """A save's cleanup used to delete every ``iter_*.tmp``: another writer's staging too."""
    mine, theirs = io.staging_dir(tmp_path, 5, "aaa"), io.staging_dir(tmp_path, 5, "bbb")
    assert mine != theirs
    for staging in (mine, theirs, io.staging_dir(tmp_path, 4)):  # the last: a killed old save
        staging.mkdir()
    io.clear_for_save(tmp_path, 5, "aaa")
    assert sorted(p.name for p in tmp_path.iterdir()) == [theirs.name]


def test_a_run_whose_every_step_is_skipped_stops_with_exit_1(tmp_path, monkeypatch, capsys):
    """A static fp16 loss scale of 2**32 overflows every step: was exit 0 with the untrained
    state saved as latest."""
    argv = train_argv("gpt2", 6, "--fp16", "--loss-scale", str(2**32), "--save", "ckpt",
                      "--save-interval", "5", "--max-skipped-iters-in-a-row", "3")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.chdir(tmp_path)
    assert pretrain_gpt.main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "--max-skipped-iters-in-a-row" in err and "iterations 1 to 3" in err, err
    assert not io.has_checkpoints(tmp_path / "ckpt")


def _watch(window: int, steps: list[tuple[bool, float]]) -> SkipWatch:
    watch = SkipWatch(window, AxisGroup.single(), torch.device("cpu"))
    for skipped, loss in steps:
        watch.add(torch.tensor(float(skipped)), torch.tensor(loss))
    return watch


def test_the_skip_window_counts_consecutive_skips_only():
    _watch(3, [(True, 1.0), (True, 1.0), (False, 1.0), (True, 1.0), (True, 1.0)]).check(5)
    with pytest.raises(TrainingError, match="iterations 2 to 4"):
        _watch(3, [(False, 1.0), (True, 1.0), (True, 1.0), (True, 1.0)]).check(4)
    with pytest.raises(TrainingError, match="3 iterations before iteration 5"):
        _watch(3, [(True, 1.0)] * 3 + [(False, 1.0)] * 2).check(5)
    _watch(0, [(True, 1.0)] * 10).check(10)  # 0: never stops


def test_a_final_state_with_a_non_finite_loss_is_never_published():
    """--lr 1e30 style: step 1 ruins the weights, every later step's loss is NaN and skipped;
    a 3-step run is far inside any window, yet its end must not save it."""
    watch = _watch(100, [(False, 5.0), (True, float("nan")), (True, float("nan"))])
    watch.check(3)  # a log line: inside the window
    with pytest.raises(TrainingError, match="not finite"):
        watch.check(3, saving=True)


def test_one_bad_batch_at_a_save_of_a_long_run_is_saved():
    """A NaN loss at the save of a healthy run is a bad batch (its step skipped, the weights
    unchanged): the save goes ahead. Three in a row are a dead model: refused. A run that
    applied no step saves the weights it loaded."""
    healthy = [(False, 5.0)] * 10
    _watch(100, [*healthy, (True, float("nan"))]).check(11, saving=True)
    _watch(100, [*healthy, *[(True, float("nan"))] * 2]).check(12, saving=True)
    with pytest.raises(TrainingError, match="not finite"):
        _watch(100, [*healthy, *[(True, float("nan"))] * 3]).check(13, saving=True)
    _watch(100, [(True, float("nan"))] * 4).check(4, saving=True)  # the loaded weights


def _quickstart_argv() -> list[str]:
    """pretrain_gpt.py's flags in scripts/quickstart.sh, on mock data."""
    text = (ROOT / "scripts" / "quickstart.sh").read_text()
    block = text.split("torchrun", 1)[1].split('"$@"', 1)[0].replace("\\\n", " ")
    words = shlex.split(block)[block.split().index("pretrain_gpt.py") + 1:]
    for flag, width in (("--data-path", 1), ("--tokenizer-type", 1), ("--tokenizer-model", 1),
                        ("--split", 1)):
        at = words.index(flag)
        del words[at:at + 1 + width]
    return [*words, "--mock-data", "--vocab-size", "2048"]


@pytest.mark.parametrize("iters", ["10", "3", "120", "5000"])
def test_quickstart_takes_a_train_iters_override(iters):
    """``bash scripts/quickstart.sh --train-iters 10`` failed: warmup 10 >= the decay."""
    validate(parse_args([*_quickstart_argv(), "--train-iters", iters]), 8)


def test_the_save_lock_leaves_the_directory_as_it_found_it(tmp_path):
    """The lock file goes with the run (removed while still locked), and a --save directory
    the lock made is removed if the run left nothing in it. A run that locked a file its
    holder removed meanwhile sees that the name no longer names it, and locks anew."""
    with SaveLock.take(tmp_path / "new"):
        assert (tmp_path / "new" / ".lock").exists()
    assert not (tmp_path / "new").exists()
    (tmp_path / "kept").mkdir()
    with SaveLock.take(tmp_path / "kept"):
        late = os.open(tmp_path / "kept" / ".lock", os.O_RDWR)  # opened as the holder ends
    assert list((tmp_path / "kept").iterdir()) == []
    try:
        assert not _same_file(late, tmp_path / "kept" / ".lock")
        with SaveLock.take(tmp_path / "kept"):
            assert not _same_file(late, tmp_path / "kept" / ".lock")
    finally:
        os.close(late)
