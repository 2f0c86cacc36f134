"""Strict loading: flags that need a checkpoint refuse to start from scratch (one line, exit
2, before any work); --no-load-optim and --no-load-rng skip exactly what they name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import pretrain_gpt
from megatron3d import device as devices
from megatron3d.checkpoint.progress import Progress
from megatron3d.log import setup_logging
from megatron3d.mpu.meta import get_meta
from megatron3d.training.build import Overrides
from tests.helpers.runs import build, train_single
from tests.helpers.tiny import train_argv

SAVED_AT, ITERS, GBS, SEQ = 3, 6, 8, 16
DROPOUT = ("--hidden-dropout", "0.1", "--attention-dropout", "0.1")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """--train-iters 6 with dropout, saved at iteration 3."""
    root = tmp_path_factory.mktemp("strict") / "run"
    assert pretrain_gpt.main(train_argv("gpt2", ITERS, *DROPOUT, "--save", str(root),
                                        "--exit-interval", str(SAVED_AT))) == 0
    return root


@pytest.mark.parametrize(("extra", "expected"), [
    (("--finetune", "--load", "{missing}"), "--finetune needs a checkpoint to load, but the "
                                            "--load directory does not exist"),
    (("--finetune", "--load", "{empty}"), "--load directory holds no checkpoint"),
    (("--skip-train", "--load", "{missing}"), "--skip-train needs a checkpoint to load"),
    (("--skip-train",), "--skip-train needs --load"),
    (("--finetune",), "--finetune needs --load"),
    (("--use-checkpoint-args", "--load", "{empty}"), "--use-checkpoint-args needs a checkpoint"),
    (("--no-load-optim",), "--no-load-optim needs --load"),
    (("--no-load-rng",), "--no-load-rng needs --load"),
], ids=["finetune-missing", "finetune-empty", "skip-train-missing", "skip-train-no-load",
        "finetune-no-load", "checkpoint-args-empty", "no-load-optim", "no-load-rng"])
def test_nothing_to_load_is_refused_in_one_line(tmp_path, capsys, extra, expected):
    (tmp_path / "empty").mkdir()
    paths = {"missing": tmp_path / "missing", "empty": tmp_path / "empty"}
    argv = train_argv("gpt2", 3, *(a.format(**paths) for a in extra))
    assert pretrain_gpt.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1, captured.err
    assert expected in captured.err, captured.err
    assert captured.out == ""  # refused before any work (nothing was logged)
    assert not (tmp_path / "missing").exists()


def test_a_plain_load_of_a_missing_directory_starts_from_scratch(tmp_path, capsys):
    assert pretrain_gpt.main(train_argv("gpt2", 3, "--load", str(tmp_path / "missing"))) == 0
    assert "starting from scratch" in capsys.readouterr().out


def _params_after_resume(argv: list[str], progress: Progress | None = None) -> dict:
    """Logical parameters after the trainer for ``argv`` ran (from ``progress`` if given)."""
    setup_logging(0, log_rank=0)
    devices.init_process_group(devices.LaunchEnv(0, 1, 0, launched=False))
    try:
        trainer, _ = build(argv, Overrides(progress=progress))
        trainer.run()
        params: dict[str, torch.Tensor] = {}
        trainer.model.data_parallel.materialize(lambda group: params.update(
            (get_meta(p).name, p.detach().clone()) for p in group))
    finally:
        torch.distributed.destroy_process_group()
    return params


def test_no_load_optim_starts_adam_afresh_from_the_loaded_weights(checkpoint, capsys):
    """One step after --no-load-optim equals one step of the loaded weights with a fresh
    optimizer (a --finetune load moved to the checkpoint's position), and differs from
    a resume that keeps Adam's moments."""
    argv = train_argv("gpt2", ITERS, "--load", str(checkpoint), "--exit-interval",
                      str(SAVED_AT + 1))  # one step
    without = _params_after_resume([*argv, "--no-load-optim"])
    assert "--no-load-optim: not loading the optimizer state" in capsys.readouterr().out
    fresh = _params_after_resume([*argv, "--finetune"], Progress(
        SAVED_AT, SAVED_AT * GBS, SAVED_AT * GBS * SEQ))
    resumed = _params_after_resume(argv)
    assert without.keys() == fresh.keys() == resumed.keys()
    for name, value in fresh.items():
        assert torch.equal(without[name], value), name
    assert any(not torch.equal(without[n], v) for n, v in resumed.items())


def test_no_load_rng_draws_fresh_dropout(checkpoint, capsys):
    argv = train_argv("gpt2", ITERS, *DROPOUT)
    setup_logging(0, log_rank=0)
    continuous = train_single(argv).losses[SAVED_AT:]
    assert train_single([*argv, "--load", str(checkpoint)]).losses == continuous
    fresh = train_single([*argv, "--load", str(checkpoint), "--no-load-rng"]).losses
    assert len(fresh) == len(continuous) and fresh[0] != continuous[0]
    assert "--no-load-rng: not restoring the saved RNG states" in capsys.readouterr().out
