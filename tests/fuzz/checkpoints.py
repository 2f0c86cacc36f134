"""The valid checkpoint the checkpoint fuzzers damage, and the load they drive in-process.

One tiny run saves iteration 3 (``tests/helpers/tiny.train_argv``, as the checkpoint tests
make theirs); each example damages a copy. ``load`` repeats what ``pretrain_gpt.main`` does
from the flags to the first step after loading (parse, validate, path checks, build the
trainer, which loads, then run it one step) on a process group that lives for the whole test,
so an example costs milliseconds instead of a process. ``sane`` is the oracle for a load that
succeeded: the position it resumes from must be one a run could have reached.
"""

from __future__ import annotations

import contextlib
import math
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import pretrain_gpt
from megatron3d import device as devices
from megatron3d.checkpoint.safety import check_paths
from megatron3d.cli.arguments import parse_args
from megatron3d.errors import Megatron3dError, TrainingError
from megatron3d.mpu.state import ParallelState
from megatron3d.training.build import build_trainer
from megatron3d.validation import validate
from tests.fuzz.common import attempt
from tests.helpers.tiny import train_argv

SAVED_ITERATION = 3
RESUME_ITERS = SAVED_ITERATION + 1  # a successful load trains exactly one more step
ITER_DIR = f"iter_{SAVED_ITERATION:07d}"
INT64_MAX = 2**63 - 1


def save_valid_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh tiny checkpoint at iteration 3 (for a module-scoped fixture)."""
    root = tmp_path_factory.mktemp("fuzz-ckpt") / "run"
    assert pretrain_gpt.main(train_argv("gpt2", RESUME_ITERS, "--save", str(root),
                                        "--exit-interval", str(SAVED_ITERATION))) == 0
    assert (root / "latest").read_text().strip() == str(SAVED_ITERATION)
    return root


def copy_of(root: Path, into: Path) -> Path:
    """A fresh copy of the valid checkpoint under ``into`` (which may already exist)."""
    target = into / "run"
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(root, target)
    return target


@contextlib.contextmanager
def process_group() -> Iterator[ParallelState]:
    """One single-process gloo group for a whole test's examples."""
    devices.init_process_group(devices.LaunchEnv(0, 1, 0, launched=False))
    try:
        yield ParallelState.build(1, 1)
    finally:
        dist.destroy_process_group()


def load(root: Path, state: ParallelState) -> tuple[bool, Megatron3dError | None]:
    """``pretrain_gpt.py ... --load root`` up to one step after loading, in this process.

    Returns (loaded, error): ``error`` is the one-line ``Megatron3dError`` a refusal raised
    (``TrainingError`` excluded: bad input must never pass for a run gone wrong); anything
    else propagates and fails the example.
    """
    def run() -> bool:
        cfg = parse_args(train_argv("gpt2", RESUME_ITERS, "--load", str(root)))
        validate(cfg, 1)
        check_paths(cfg.checkpoint)
        trainer = build_trainer(cfg, state, torch.device("cpu"))
        try:
            trainer.run()
        except TrainingError as err:
            raise AssertionError(f"bad input reported as a failed run: {err}") from None
        return True

    loaded, error = attempt(run, Megatron3dError)
    return bool(loaded), error


def sane(meta: Any) -> bool:
    """Whether ``meta`` is a position a run could have saved: counters are non-negative
    int64 values, Adam's step a finite non-negative number."""
    if not isinstance(meta, dict):
        return False
    counters = [meta.get(k) for k in ("iteration", "consumed_samples", "consumed_tokens")]
    if not all(type(v) is int and 0 <= v <= INT64_MAX for v in counters):
        return False
    step = meta.get("adam_step")
    return type(step) in (int, float) and math.isfinite(step) and 0 <= step <= INT64_MAX
