"""Exact resume and resharding: a checkpoint continues the run as if it never stopped, in the
same layout bitwise, in any other layout to fp32 rounding."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.helpers.runs import merge_ranks, train, train_single
from tests.helpers.tiny import train_argv

LAYOUT_222 = ("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
              "--zero-stage", "1", "--pp-partition-method", "uniform")
# Global batch 16 ramps 4 -> 8 -> 12 -> 16 over 48 samples: step 5 is inside the ramp.
RAMP = ("--global-batch-size", "16", "--rampup-batch-size", "4", "4", "48")


def _argv(*extra: str, dropout: str = "0.1") -> list[str]:
    return train_argv("bloom", 12, *RAMP, "--hidden-dropout", dropout, "--attention-dropout",
                      dropout, *extra)


STOP_AT_6 = ("--exit-interval", "6")  # step 6 of the same 12-iteration schedule
ZERO3_TP2_DP2 = ("--tensor-model-parallel-size", "2", "--zero-stage", "3")
ZERO1_DP4 = ("--zero-stage", "1")


def _continue_after_save(directory: str, layout: tuple[str, ...]) -> dict:
    """12 steps straight; 5 steps then save and stop; a fresh trainer loads and runs to 12."""
    continuous = train(_argv(*layout))
    stopped = train(_argv(*layout, "--save", directory, "--exit-interval", "5"))
    resumed = train(_argv(*layout, "--load", directory))
    return {"continuous": continuous, "stopped": stopped, "resumed": resumed}


@pytest.mark.parametrize(("layout", "world"), [(LAYOUT_222, 8), (ZERO3_TP2_DP2, 4)],
                         ids=["tp2-pp2-dp2-zero1", "tp2-dp2-zero3"])
def test_resume_is_bitwise_exact(tmp_path, layout, world):
    per_rank = run_distributed(_continue_after_save, world, str(tmp_path / "ckpt"), layout,
                               timeout_s=300)
    runs = {k: merge_ranks([r[k] for r in per_rank]) for k in per_rank[0]}
    assert len(runs["stopped"].losses) == 5 and len(runs["resumed"].losses) == 7
    assert runs["stopped"].losses == runs["continuous"].losses[:5]
    assert runs["resumed"].losses == runs["continuous"].losses[5:]  # bitwise
    assert runs["resumed"].grad_norms == runs["continuous"].grad_norms[5:]
    for name, value in runs["continuous"].params.items():
        assert torch.equal(runs["resumed"].params[name], value), name


def _save_at_5(directory: str) -> list[float]:
    """Train 6 steps at (2, 2, 2) ZeRO-1; separately save a checkpoint at step 5."""
    train(_argv(*LAYOUT_222, "--save", directory, "--exit-interval", "5", dropout="0"))
    return train(_argv(*LAYOUT_222, *STOP_AT_6, dropout="0")).losses


def _first_loss_after_load(directory: str, tp: int, pp: int) -> list[float]:
    layout = ("--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size",
              str(pp), "--pp-partition-method", "uniform")
    return [train(_argv(*layout, "--zero-stage", str(zero), "--load", directory,
                        *STOP_AT_6, dropout="0")).losses
            for zero in (0, 1)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[str, float]:
    directory = str(tmp_path_factory.mktemp("reshard") / "ckpt")
    losses = run_distributed(_save_at_5, 8, directory, timeout_s=300)
    last_stage = losses[-1]
    return directory, last_stage[5]


@pytest.mark.parametrize(("tp", "pp", "dp"), [(4, 1, 2), (1, 4, 1)])
def test_reshard_on_load(saved, tp, pp, dp):
    directory, expected = saved
    per_rank = run_distributed(_first_loss_after_load, tp * pp * dp, directory, tp, pp,
                               timeout_s=300)
    for zero, losses in enumerate(per_rank[-1]):  # the last rank is on the last stage
        assert len(losses) == 1
        assert losses[0] == pytest.approx(expected, rel=1e-6), f"ZeRO-{zero}"


def test_reshard_into_one_process(saved):
    directory, expected = saved
    result = train_single(_argv("--load", directory, *STOP_AT_6, dropout="0"))
    assert result.losses[0] == pytest.approx(expected, rel=1e-6)


def _save_then_load(directory: str, saving: tuple[str, ...], loading: tuple[str, ...]) -> tuple:
    """Save at step 5 in one layout and note step 6's loss; load into another, run step 6
    (micro-batch 1, so the ramp divides by DP 4 too)."""
    saving, loading = (*saving, "--micro-batch-size", "1"), (*loading, "--micro-batch-size", "1")
    train(_argv(*saving, "--save", directory, "--exit-interval", "5", dropout="0"))
    expected = train(_argv(*saving, *STOP_AT_6, dropout="0")).losses[5]
    loaded = train(_argv(*loading, "--load", directory, *STOP_AT_6,
                         dropout="0"))
    return expected, loaded.losses


@pytest.mark.parametrize(("saving", "loading"), [(ZERO3_TP2_DP2, ZERO1_DP4),
                                                 (ZERO1_DP4, ZERO3_TP2_DP2)],
                         ids=["zero3-tp2-dp2-to-zero1-dp4", "zero1-dp4-to-zero3-tp2-dp2"])
def test_reshard_between_zero1_and_zero3(tmp_path, saving, loading):
    expected, losses = run_distributed(_save_then_load, 4, str(tmp_path / "ckpt"), saving,
                                       loading, timeout_s=300)[-1]
    assert len(losses) == 1 and losses[0] == pytest.approx(expected, rel=1e-6)
