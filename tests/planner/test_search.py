"""Feasible in the planner is accepted by pretrain_gpt.py's validation, and the reverse: on
200 generated layouts the two agree, with the same message. Every reason a layout can be
infeasible for has a case here, and the ranking puts feasible layouts first, fastest first.
"""

from __future__ import annotations

import random

import pytest

from megatron3d.cli.arguments import parse_args
from megatron3d.errors import ConfigError
from megatron3d.planner.hardware import Cluster
from megatron3d.planner.layout import RECOMPUTE, Layout
from megatron3d.planner.search import Fixed, Planner, candidates
from megatron3d.validation import validate
from tests.helpers.tiny import FLAVOUR_FLAGS

SAMPLES = 200
ROOMY = 1e6  # GiB per GPU: memory never decides in the agreement test
METHODS = ("parameters", "parameters", "uniform", "type:transformer|embedding",
           "type:Transformer", "type:nothing", "type:(")


def _model_flags(rng: random.Random, unit: int) -> list[str]:
    """A tiny model and batch; mostly sound, sometimes not (``unit``: micro-batch x DP)."""
    heads = rng.choice((2, 4, 4, 6))
    gbs = unit * rng.choice((1, 2, 4)) if rng.random() < 0.8 else rng.choice((6, 10, 12))
    flags = ["--num-layers", str(rng.randint(1, 4)), "--hidden-size", str(heads * 8),
             "--num-attention-heads", str(heads), "--seq-length", rng.choice(("16", "16", "18")),
             "--vocab-size", "203", "--make-vocab-size-divisible-by", "8",
             "--lr", "1e-3", "--train-samples", "4096", "--mock-data",
             "--global-batch-size", str(gbs), *FLAVOUR_FLAGS[rng.choice(list(FLAVOUR_FLAGS))]]
    if rng.random() < 0.2:
        start = rng.choice((unit, 2, 3))
        flags += ["--rampup-batch-size", str(start), str(max(1, gbs - start)), "512"]
    if rng.random() < 0.5:
        flags.append("--bf16")
    if rng.random() < 0.2:
        flags += ["--group-query-attention", "--num-query-groups", str(rng.choice((1, 2)))]
    return flags


def _sample(rng: random.Random) -> tuple[list[str], int, Layout]:
    """A layout on a matching world size most of the time, any other sometimes."""
    tp, pp, dp = rng.choice((1, 2, 2, 4, 3)), rng.choice((1, 2, 3)), rng.choice((1, 2))
    world = tp * pp * dp if rng.random() < 0.85 else rng.choice((1, 3, 5, 8))
    mbs = rng.choice((1, 2, 3))
    layout = Layout(tp, pp, max(1, world // (tp * pp)), mbs, rng.choice((0, 1, 3)),
                    rng.choice(RECOMPUTE), rng.choice(METHODS), rng.choice((1, 1, 1, 2, 3)),
                    rng.random() < 0.2)
    return _model_flags(rng, mbs * layout.dp), world, layout


def test_planner_and_validation_agree_on_200_layouts():
    rng = random.Random(18)
    outcomes = []
    for _ in range(SAMPLES):
        flags, world, layout = _sample(rng)
        try:
            cfg = parse_args(flags)
        except ConfigError:  # a model refused while parsing: not a layout question
            continue
        plan = Planner(cfg, Cluster(1, world, gpu_memory_gb=ROOMY)).judge(layout)
        try:
            validate(layout.apply(cfg), world)
            accepted = ""
        except ConfigError as err:
            accepted = str(err)
        assert plan.feasible == (not accepted), (flags, world, layout, plan.reason)
        assert plan.reason == accepted, (flags, world, layout)
        outcomes.append(plan.feasible)
    assert len(outcomes) >= SAMPLES * 0.9
    assert sum(outcomes) >= 30 and len(outcomes) - sum(outcomes) >= 30  # both kinds, often


TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--vocab-size", "203", "--make-vocab-size-divisible-by", "8",
        "--lr", "1e-3", "--train-iters", "10", "--mock-data", "--global-batch-size", "8"]
L = Layout

REASONS = [  # (extra flags, GPUs, layout, the reason)
    ([], 3, L(3, 1, 1, 2, 0, "none", "parameters"),
     "--num-attention-heads 4 is not divisible by the tensor-parallel size"),
    (["--group-query-attention", "--num-query-groups", "1"], 2,
     L(2, 1, 1, 2, 0, "none", "parameters"),
     "--num-query-groups 1 is not divisible by the tensor-parallel size"),
    (["--ffn-hidden-size", "99"], 2, L(2, 1, 1, 2, 0, "none", "parameters"),
     "--ffn-hidden-size 99 is not divisible by the tensor-parallel size"),
    (["--seq-length", "18"], 4, L(4, 1, 1, 2, 0, "none", "parameters", sequence_parallel=True),
     "--seq-length 18 is not divisible by the tensor-parallel size"),
    ([], 3, L(2, 1, 1, 2, 0, "none", "parameters"), "world size 3 is not divisible by tp*pp"),
    ([], 4, L(1, 1, 4, 4, 1, "none", "parameters"),
     "not divisible by --micro-batch-size 4 x data-parallel size 4 = 16"),
    (["--rampup-batch-size", "2", "2", "64"], 2, L(1, 1, 2, 2, 0, "none", "parameters"),
     "--rampup-batch-size: global batch size(s) 2, 6 not divisible"),
    (["--global-batch-size", "6"], 2, L(1, 2, 1, 2, 0, "none", "parameters", 2),
     "micro-batches per step in multiples of PP = 2, got 3"),
    ([], 1, L(1, 1, 1, 2, 0, "none", "parameters", 2), "needs pipeline parallelism"),
    ([], 8, L(1, 8, 1, 2, 0, "none", "parameters"),
     "8 pipeline stages but only 5 of 5 layers have parameters"),
    ([], 4, L(1, 2, 2, 2, 0, "none", "parameters", 4),
     "2 x 4 virtual pipeline stages but only 5 of 5 layers have parameters"),
    ([], 2, L(1, 2, 1, 2, 0, "none", "type:nothing"), "only 0 of 5 layers match type:nothing"),
    ([], 1, L(1, 1, 1, 2, 0, "none", "type:("), "invalid regex in the partition method"),
]


@pytest.mark.parametrize(("extra", "gpus", "layout", "reason"), REASONS,
                         ids=[case[3][:40] for case in REASONS])
def test_every_reason_a_layout_fails_for(extra, gpus, layout, reason):
    plan = Planner(parse_args(TINY + extra), Cluster(1, gpus)).judge(layout)
    assert not plan.feasible and reason in plan.reason, plan.reason
    assert plan.memory is None and plan.time is None


def test_out_of_memory_names_the_fullest_rank_its_phase_and_its_parts():
    layout = L(1, 2, 1, 2, 0, "none", "parameters")
    plan = Planner(parse_args(TINY), Cluster(1, 2, gpu_memory_gb=0.5)).judge(layout)
    assert not plan.feasible and plan.memory.total > 0.5 * 2**30  # CUDA's context: 1.5 GiB
    assert plan.reason.startswith(
        f"out of memory: pipeline rank {plan.fullest_rank} needs "
        f"{plan.memory.total / 2**30:.1f} GiB ({plan.memory.peak.phase}) of 0.4 GiB usable "
        "(0.5 GiB less 10% headroom) -- parameters 0.0, gradients 0.0, ")
    assert plan.reason.endswith(f"allocator, CUDA and NCCL "
                                f"{(plan.memory.total - plan.memory.peak.allocated) / 2**30:.1f}")
    assert plan.time is not None  # still timed, ranked after the feasible ones


def test_the_headroom_decides_feasibility():
    """A layout is feasible up to (1 - headroom) x the GPU's memory, and no further."""
    layout = L(1, 2, 1, 2, 0, "none", "parameters")
    need = Planner(parse_args(TINY), Cluster(1, 2)).judge(layout).memory.total / 2**30
    for headroom, fits in ((0.0, True), (0.1, False)):
        cfg = parse_args([*TINY, "--memory-headroom", str(headroom)])
        assert Planner(cfg, Cluster(1, 2, gpu_memory_gb=need * 1.0001)).judge(
            layout).feasible == fits
    cfg = parse_args([*TINY, "--memory-headroom", "0.1"])
    assert Planner(cfg, Cluster(1, 2, gpu_memory_gb=need / 0.9 * 1.0001)).judge(layout).feasible


def test_fixed_dimensions_are_not_enumerated():
    fixed = Fixed(tp=2, micro_batch_size=4, recompute="full", zero_stage=1, virtual=1,
                  partition_method="uniform")
    layouts = candidates(16, 11, 8, fixed)
    assert layouts and all(
        (lay.tp, lay.micro_batch_size, lay.recompute, lay.zero_stage, lay.virtual,
         lay.partition_method) == (2, 4, "full", 1, 1, "uniform") for lay in layouts)
    assert {lay.pp for lay in layouts} == {1, 2, 4, 8}
    assert {lay.tp for lay in candidates(16, 11, 4, Fixed())} == {1, 2, 4}  # up to a node
    assert {lay.pp for lay in candidates(16, 3, 8, Fixed(tp=1))} == {1, 2}  # layers enough


def test_ranking_puts_feasible_layouts_first_fastest_first():
    roomy = Planner(parse_args(TINY), Cluster(1, 4)).plan(Fixed(micro_batch_size=2))
    totals = sorted(p.memory.total for p in roomy if p.memory is not None)
    median = totals[len(totals) // 2] / 2**30  # half the layouts that pass validation fit
    plans = Planner(parse_args(TINY), Cluster(1, 4, gpu_memory_gb=median)).plan(
        Fixed(micro_batch_size=2))
    kinds = [(not p.feasible, p.memory is None) for p in plans]
    assert kinds == sorted(kinds) and kinds[0] == (False, False) and kinds[-1] == (True, True)
    assert (True, False) in kinds  # out of memory, after the feasible ones
    times = [p.time.iteration_s for p in plans if p.feasible]
    assert times == sorted(times)
