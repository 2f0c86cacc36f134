"""The up-front memory check: ``check_fits`` refuses, before any process group starts, a
layout whose predicted peak (build, training step, evaluation or save, on its fullest
pipeline rank) leaves less than ``--memory-headroom`` of the device free, with the very
numbers the topology planner ranks layouts by."""

from __future__ import annotations

import re

import pytest
import torch

from megatron3d.accounting.fit import check_fits, layout_memory
from megatron3d.cli.arguments import parse_args
from megatron3d.errors import ConfigError
from megatron3d.model.context import LayerContext
from megatron3d.model.gpt import build_gpt
from megatron3d.mpu.state import AxisGroup
from megatron3d.planner.hardware import GIB, Cluster
from megatron3d.planner.layout import Layout
from megatron3d.planner.search import Planner
from megatron3d.validation import validate
from tests.helpers.tiny import train_argv


def _cfg(*extra: str):
    return parse_args(train_argv("gpt2", 10, *extra))


def _peak(cfg, world_size: int, device_type: str = "cuda") -> int:
    return max(rank.total for rank in layout_memory(cfg, world_size, device_type))


def test_one_rank_states_are_the_whole_model_in_zero_papers_accounting():
    """fp32, no parallelism: 4 (weights) + 4 (gradients) + 8 (two Adam moments) bytes per
    parameter of the model as built."""
    cfg = _cfg()
    model = build_gpt(LayerContext(cfg.model, AxisGroup.single(), cfg.training.seed,
                                   device=torch.device("meta")))
    params = sum(p.numel() for p in model.parameters())
    assert layout_memory(cfg, 1)[0].states.total == 16 * params


def test_parallelism_lowers_the_fullest_ranks_states():
    def states(cfg, world: int) -> int:
        return max(rank.states.total for rank in layout_memory(cfg, world))

    one = states(_cfg(), 1)
    assert states(_cfg("--tensor-model-parallel-size", "2"), 2) < one
    assert states(_cfg("--pipeline-model-parallel-size", "2"), 2) < one
    assert states(_cfg("--zero-stage", "3"), 4) < one  # slices, and the slots' units


def test_check_fits_refuses_what_leaves_less_than_the_headroom():
    cfg = _cfg()
    need = _peak(cfg, 1)
    check_fits(cfg, 1, int(need / 0.9) + 1)  # the default headroom: 10%
    with pytest.raises(ConfigError, match="the layout does not fit: out of memory: pipeline "
                       r"rank 0 needs .* GiB \(\w+\) of .* GiB usable") as info:
        check_fits(cfg, 1, need)
    assert "\n" not in str(info.value) and "--memory-headroom" in str(info.value)
    check_fits(_cfg("--memory-headroom", "0"), 1, need)
    with pytest.raises(ConfigError, match="the layout does not fit"):
        check_fits(_cfg("--memory-headroom", "0"), 1, need - 1)


def test_check_fits_and_the_planner_judge_a_layout_alike():
    """Same model, same verdict: the planner's fullest rank is the start-up check's."""
    cfg = _cfg("--bf16")
    layout = Layout(2, 2, 1, 2, 0, "full", "parameters", 1, True)
    applied = layout.apply(cfg)
    need = _peak(applied, 4)
    for gib, fits in ((need / 0.9 / GIB * 1.001, True), (need / GIB, False)):
        plan = Planner(cfg, Cluster(1, 4, gpu_memory_gb=gib)).judge(layout)
        assert plan.memory.total == need and plan.feasible == fits
        if fits:
            check_fits(applied, 4, int(gib * GIB))
        else:
            with pytest.raises(ConfigError, match=re.escape(plan.reason.split(" -- ")[0])):
                check_fits(applied, 4, int(gib * GIB))


def test_the_cpu_has_no_device_overheads():
    rank = layout_memory(_cfg(), 1, "cpu")[0]
    assert all(p.total == p.allocated for p in rank.phases)
    cuda = layout_memory(_cfg(), 1, "cuda")[0]
    assert all(c.total == c.allocated + c.reserve + c.context and c.reserve > 0
               for c in cuda.phases)  # one rank: no NCCL communicator


def test_the_memory_headroom_flag_is_a_share_below_one():
    validate(_cfg("--memory-headroom", "0.5"), 1)
    for bad in ("1", "-0.1"):
        with pytest.raises(ConfigError, match="--memory-headroom"):
            validate(_cfg("--memory-headroom", bad), 1)
