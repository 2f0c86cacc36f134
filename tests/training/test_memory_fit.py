"""The up-front memory check: a lower bound on the fullest rank's model-state bytes, which
refuses a run that cannot fit before any process group starts, and never a run that fits."""

from __future__ import annotations

import pytest
import torch

from megatron3d.accounting.memory import check_fits, fullest_rank_lower_bound
from megatron3d.cli.arguments import parse_args
from megatron3d.errors import ConfigError
from megatron3d.model.context import LayerContext
from megatron3d.model.gpt import build_gpt
from megatron3d.mpu.state import AxisGroup
from tests.helpers.tiny import train_argv


def _cfg(*extra: str):
    return parse_args(train_argv("gpt2", 10, *extra))


def test_one_rank_bound_is_the_whole_model_in_zero_papers_accounting():
    """fp32, no parallelism: 4 (weights) + 4 (gradients) + 8 (two Adam moments) bytes per
    parameter of the model as built."""
    cfg = _cfg()
    model = build_gpt(LayerContext(cfg.model, AxisGroup.single(), cfg.training.seed,
                                   device=torch.device("meta")))
    params = sum(p.numel() for p in model.parameters())
    assert fullest_rank_lower_bound(cfg, 1) == 16 * params


def test_parallelism_lowers_the_bound():
    one = fullest_rank_lower_bound(_cfg(), 1)
    assert fullest_rank_lower_bound(_cfg("--tensor-model-parallel-size", "2"), 2) < one
    assert fullest_rank_lower_bound(_cfg("--pipeline-model-parallel-size", "2"), 2) < one
    assert fullest_rank_lower_bound(_cfg("--zero-stage", "3"), 4) == pytest.approx(one / 4, 0.01)
    assert fullest_rank_lower_bound(_cfg("--bf16"), 1) == one * 18 // 16  # + fp32 master


def test_check_fits_refuses_only_what_cannot_fit():
    cfg = _cfg()
    need = fullest_rank_lower_bound(cfg, 1)
    check_fits(cfg, 1, need)
    with pytest.raises(ConfigError, match="the model does not fit") as info:
        check_fits(cfg, 1, need - 1)
    assert "\n" not in str(info.value)
