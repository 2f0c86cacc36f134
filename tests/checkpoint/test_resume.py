"""Exact resume and resharding: a checkpoint continues the run as if it never stopped, in the
same layout bitwise (reading only the rank's own file), in any other layout to fp32 rounding
for three steps, so that moments lost or misplaced in resharding show."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch

from megatron3d.checkpoint import chunk_index
from tests.helpers.dist import run_distributed
from tests.helpers.files import opened_files
from tests.helpers.runs import RunResult, assert_same_run, merge_ranks, train, train_single
from tests.helpers.tiny import train_argv
from tests.helpers.tolerances import EQUIVALENCE_FLAGS, FP32

LAYOUT_222 = ("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
              "--zero-stage", "1", "--pp-partition-method", "uniform")
# Global batch 16 ramps 4 -> 8 -> 12 -> 16 over 48 samples: step 5 is inside the ramp.
RAMP = ("--global-batch-size", "16", "--rampup-batch-size", "4", "4", "48")


def _argv(*extra: str, dropout: str = "0.1") -> list[str]:
    return train_argv("bloom", 12, *RAMP, "--hidden-dropout", dropout, "--attention-dropout",
                      dropout, *extra)


STOP_AT_8 = ("--exit-interval", "8")  # three steps after the checkpoint at step 5
ZERO3_TP2_DP2 = ("--tensor-model-parallel-size", "2", "--zero-stage", "3")
ZERO1_DP4 = ("--zero-stage", "1")
ZERO0_PP2_DP2 = ("--pipeline-model-parallel-size", "2", "--zero-stage", "0",
                 "--pp-partition-method", "uniform")


def _continue_after_save(directory: str, layout: tuple[str, ...]) -> dict:
    """12 steps straight; 5 steps then save and stop; a fresh trainer loads and runs to 12,
    noting the files it opened."""
    continuous = train(_argv(*layout))
    stopped = train(_argv(*layout, "--save", directory, "--exit-interval", "5"))
    with opened_files() as opened:
        resumed = train(_argv(*layout, "--load", directory))
    return {"continuous": continuous, "stopped": stopped, "resumed": resumed, "opened": opened}


@pytest.mark.parametrize(("layout", "world"), [(LAYOUT_222, 8), (ZERO3_TP2_DP2, 4),
                                               (ZERO0_PP2_DP2, 4)],
                         ids=["tp2-pp2-dp2-zero1", "tp2-dp2-zero3", "pp2-dp2-zero0"])
def test_resume_is_bitwise_exact_reading_only_the_ranks_own_file(tmp_path, layout, world):
    """What a rank holds but another saved (TP replicas, the tied embedding's last-stage copy,
    DP replicas without ZeRO) comes from that rank, not from its file."""
    per_rank = run_distributed(_continue_after_save, world, str(tmp_path / "ckpt"), layout,
                               timeout_s=300)
    runs = {k: merge_ranks([r[k] for r in per_rank]) for k in ("continuous", "stopped",
                                                               "resumed")}
    assert len(runs["stopped"].losses) == 5 and len(runs["resumed"].losses) == 7
    assert runs["stopped"].losses == runs["continuous"].losses[:5]
    assert runs["resumed"].losses == runs["continuous"].losses[5:]  # bitwise
    assert runs["resumed"].grad_norms == runs["continuous"].grad_norms[5:]
    for name, value in runs["continuous"].params.items():
        assert torch.equal(runs["resumed"].params[name], value), name
    assert [r["opened"] for r in per_rank] == [[f"rank_{r:05d}.pt"] for r in range(world)]


def _reshard_argv(*extra: str) -> list[str]:
    """Runs compared across layouts: no dropout (another layout draws other streams), Adam
    eps as in the equivalence tests (``EQUIVALENCE_FLAGS``)."""
    return _argv(*extra, *EQUIVALENCE_FLAGS, dropout="0")


def _save_at_5(directory: str) -> RunResult:
    """Train 8 steps at (2, 2, 2) ZeRO-1; separately save a checkpoint at step 5."""
    train(_reshard_argv(*LAYOUT_222, "--save", directory, "--exit-interval", "5"))
    return train(_reshard_argv(*LAYOUT_222, *STOP_AT_8))


def _assert_continues(resumed: RunResult, continuous: RunResult) -> None:
    """Steps 6 to 8 after loading, and the weights and validation loss after them, are the
    uninterrupted run's to fp32 rounding: the Adam moments and step came through too."""
    assert len(resumed.losses) == 3
    assert_same_run(resumed, dataclasses.replace(continuous, losses=continuous.losses[5:],
                                                 grad_norms=continuous.grad_norms[5:]), FP32)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, RunResult]:
    """The step-5 checkpoint (saving writes its chunk index) and the uninterrupted run to step 8."""
    directory = tmp_path_factory.mktemp("reshard") / "ckpt"
    continuous = merge_ranks(run_distributed(_save_at_5, 8, str(directory), timeout_s=300))
    return directory, continuous


def _train_after_load(directory: str, tp: int, pp: int) -> list[RunResult]:
    layout = ("--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size",
              str(pp), "--pp-partition-method", "uniform")
    return [train(_reshard_argv(*layout, "--zero-stage", str(zero), "--load", directory,
                                *STOP_AT_8))
            for zero in (0, 1)]


@pytest.mark.parametrize(("tp", "pp", "dp"), [(4, 1, 2), (1, 4, 1)])
def test_reshard_on_load(saved, tp, pp, dp):
    directory, continuous = saved
    per_rank = run_distributed(_train_after_load, tp * pp * dp, str(directory), tp, pp,
                               timeout_s=300)
    for zero in (0, 1):
        try:
            _assert_continues(merge_ranks([r[zero] for r in per_rank]), continuous)
        except AssertionError as err:
            raise AssertionError(f"ZeRO-{zero}: {err}") from err


def test_reshard_into_one_process_without_an_index(saved, tmp_path):
    """A checkpoint saved before chunk indexes existed: every rank file's chunk list is read."""
    directory, continuous = saved
    old = tmp_path / "old"
    shutil.copytree(directory, old)
    (old / "iter_0000005" / chunk_index.INDEX).unlink()
    _assert_continues(train_single(_reshard_argv("--load", str(old), *STOP_AT_8)), continuous)


def _save_then_load(directory: str, saving: tuple[str, ...],
                    loading: tuple[str, ...]) -> tuple[RunResult, RunResult]:
    """Save at step 5 in one layout and run it on to step 8; load into another and run steps
    6 to 8 (micro-batch 1, so the ramp divides by DP 4 too)."""
    saving, loading = (*saving, "--micro-batch-size", "1"), (*loading, "--micro-batch-size", "1")
    train(_reshard_argv(*saving, "--save", directory, "--exit-interval", "5"))
    continuous = train(_reshard_argv(*saving, *STOP_AT_8))
    return continuous, train(_reshard_argv(*loading, "--load", directory, *STOP_AT_8))


@pytest.mark.cuda
@pytest.mark.parametrize(("saving", "loading"), [(ZERO3_TP2_DP2, ZERO1_DP4),
                                                 (ZERO1_DP4, ZERO3_TP2_DP2)],
                         ids=["zero3-tp2-dp2-to-zero1-dp4", "zero1-dp4-to-zero3-tp2-dp2"])
def test_reshard_between_zero1_and_zero3(tmp_path, saving, loading):
    per_rank = run_distributed(_save_then_load, 4, str(tmp_path / "ckpt"), saving, loading,
                               timeout_s=300)
    continuous, resumed = (merge_ranks([r[i] for r in per_rank]) for i in (0, 1))
    _assert_continues(resumed, continuous)
