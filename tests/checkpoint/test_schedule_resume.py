"""Resuming with a changed learning-rate schedule is refused in one line unless a flag says
which schedule to follow (Megatron's --override-opt_param-scheduler and
--use-checkpoint-opt_param-scheduler); either way the learning rate continues as it says."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import pretrain_gpt
from megatron3d.optim.lr_schedule import LRSchedule
from tests.helpers.runs import learning_rates
from tests.helpers.tiny import train_argv

SAVED_AT, ITERS, LONGER = 3, 6, 10
GBS = 8  # train_argv's global batch; lr 3e-3 -> 3e-4, cosine, 2 warmup iterations
OVERRIDE = "--override-opt_param-scheduler"  # Megatron's spelling, named in the error
USE_SAVED = "--use-checkpoint-opt_param-scheduler"
FLAGS = {OVERRIDE: "--override-opt-param-scheduler",  # our spelling of each
         USE_SAVED: "--use-checkpoint-opt-param-scheduler"}


def _schedule(iters: int) -> LRSchedule:
    """What train_argv(iters) asks for, spelled out independently of from_config."""
    return LRSchedule(max_lr=3e-3, min_lr=3e-4, warmup_samples=2 * GBS,
                      decay_samples=iters * GBS, style="cosine")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A run of --train-iters 6 saved at iteration 3."""
    root = tmp_path_factory.mktemp("schedule") / "run"
    assert pretrain_gpt.main(train_argv("gpt2", ITERS, "--save", str(root), "--exit-interval",
                                        str(SAVED_AT))) == 0
    return root


def test_the_checkpoint_records_the_schedule(checkpoint):
    meta = json.loads((checkpoint / f"iter_{SAVED_AT:07d}" / "meta.json").read_text())
    assert LRSchedule(**meta["lr_schedule"]) == _schedule(ITERS)


def test_a_changed_run_length_is_refused_in_one_line(checkpoint, capsys):
    assert pretrain_gpt.main(train_argv("gpt2", LONGER, "--load", str(checkpoint))) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert f"checkpoint vs flags: decay samples: {ITERS * GBS} vs {LONGER * GBS}" in err
    assert OVERRIDE in err and USE_SAVED in err and "--lr:" not in err


def test_the_same_schedule_resumes_without_a_flag(checkpoint, capsys):
    assert learning_rates(train_argv("gpt2", ITERS, "--load", str(checkpoint)))[0] == (
        _schedule(ITERS).lr_at(SAVED_AT * GBS))


@pytest.mark.parametrize(("flag", "followed"), [(OVERRIDE, LONGER), (USE_SAVED, ITERS)])
def test_each_flag_continues_with_its_schedule(checkpoint, flag, followed):
    lrs = learning_rates(train_argv("gpt2", LONGER, "--load", str(checkpoint), FLAGS[flag]))
    assert len(lrs) == LONGER - SAVED_AT
    expected = [_schedule(followed).lr_at(i * GBS) for i in range(SAVED_AT, LONGER)]
    assert lrs == expected
    other = LONGER + ITERS - followed
    assert lrs[0] != _schedule(other).lr_at(SAVED_AT * GBS)  # the two schedules differ there


def test_both_flags_are_refused(checkpoint, capsys):
    assert pretrain_gpt.main(train_argv("gpt2", LONGER, "--load", str(checkpoint),
                                        *FLAGS.values())) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "drop one of the two flags" in err, err


def test_a_checkpoint_without_the_record_follows_the_flags(checkpoint, tmp_path, capsys):
    old = tmp_path / "old"
    shutil.copytree(checkpoint, old)
    meta_path = old / f"iter_{SAVED_AT:07d}" / "meta.json"
    meta = json.loads(meta_path.read_text())
    del meta["lr_schedule"]
    meta_path.write_text(json.dumps(meta))
    assert learning_rates(train_argv("gpt2", LONGER, "--load", str(old)))[0] == (
        _schedule(LONGER).lr_at(SAVED_AT * GBS))
    assert pretrain_gpt.main(train_argv("gpt2", LONGER, "--load", str(old),
                                        FLAGS[USE_SAVED])) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "saved before checkpoints recorded" in err, err


def test_a_longer_constant_schedule_resumes_without_a_flag(tmp_path):
    """The decay length does not shape a constant learning rate, so extending the run changes
    nothing a flag would have to decide (a changed --lr still would)."""
    constant = ("--lr-decay-style", "constant")
    root = tmp_path / "run"
    assert pretrain_gpt.main(train_argv("gpt2", ITERS, "--save", str(root), "--exit-interval",
                                        str(SAVED_AT), *constant)) == 0
    lrs = learning_rates(train_argv("gpt2", LONGER, "--load", str(root), *constant))
    assert lrs == [3e-3] * (LONGER - SAVED_AT)
    assert pretrain_gpt.main(train_argv("gpt2", LONGER, "--load", str(root), *constant,
                                        "--lr", "1e-3")) == 2
