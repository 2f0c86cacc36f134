"""A Llama-2-70B-shaped model (80 layers, hidden 8192, 64 heads in 8 query groups, SwiGLU
MLP of 28672, RMSNorm, rotary positions, untied embeddings, vocabulary 32000, sequence 4096,
no dropout; GBS 1024 sequences, Llama 2's 4M tokens) on 16 nodes of 8 x A100-80GB.

The planner's first choice leaves the default 10% headroom free (layouts that would fit only
into it are refused), the search tries sequence parallelism and selective recompute, the
layout an earlier planner put first at 79.5 of 80 GiB (TP 8 x PP 8 x DP 2, micro-batch 1,
ZeRO-1, no recompute) is now out of memory, and so is ZeRO-3 over all 128 ranks, at build. The
partition method is fixed to the default ``parameters`` to keep the test short (the full
search, 11,124 layouts, picks the same first layout).
"""

from __future__ import annotations

import pytest

from megatron3d.cli.arguments import parse_args
from megatron3d.planner.hardware import GIB, Cluster
from megatron3d.planner.layout import Layout
from megatron3d.planner.search import Fixed, Planner

LLAMA_2_70B = [
    "--num-layers", "80", "--hidden-size", "8192", "--num-attention-heads", "64",
    "--group-query-attention", "--num-query-groups", "8", "--ffn-hidden-size", "28672",
    "--vocab-size", "32000", "--seq-length", "4096", "--swiglu", "--normalization", "rmsnorm",
    "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
    "--disable-bias-linear", "--hidden-dropout", "0", "--attention-dropout", "0", "--bf16",
    "--global-batch-size", "1024", "--lr", "1.5e-4", "--train-iters", "1", "--mock-data"]
GPU_GIB = 80


@pytest.fixture(scope="module")
def plans():
    return Planner(parse_args(LLAMA_2_70B), Cluster(nodes=16, gpus_per_node=8)).plan(
        Fixed(partition_method="parameters"))


def test_first_choice_stays_below_90_percent_of_memory(plans):
    first = plans[0]
    assert first.feasible, first.reason
    assert first.memory.total <= 0.9 * GPU_GIB * GIB, first.memory.total / GIB
    assert all(p.memory.total <= 0.9 * GPU_GIB * GIB for p in plans if p.feasible)
    edge = [p for p in plans if p.memory is not None
            and 0.9 * GPU_GIB * GIB < p.memory.total <= GPU_GIB * GIB]
    assert edge and not any(p.feasible for p in edge)  # would fit, but for the headroom
    assert "(80.0 GiB less 10% headroom)" in edge[0].reason


def test_search_tries_sequence_parallelism_and_selective_recompute(plans):
    feasible = [p.layout for p in plans if p.feasible]
    assert any(lay.sequence_parallel for lay in feasible)
    assert any(lay.recompute == "selective" for lay in feasible)
    assert not any(p.layout.sequence_parallel for p in plans if p.layout.tp == 1)


def test_the_old_first_choice_at_the_edge_is_out_of_memory(plans):
    old = next(p for p in plans if p.layout == Layout(8, 8, 2, 1, 1, "none", "parameters"))
    assert not old.feasible and old.reason.startswith("out of memory")
    with_sp = next(p for p in plans
                   if p.layout == Layout(8, 8, 2, 1, 1, "none", "parameters", 1, True))
    assert with_sp.feasible  # sequence parallelism shrinks what the blocks keep by TP


def test_zero3_over_128_ranks_builds_in_its_shards(plans):
    """No rank ever holds the model unsharded (129 GiB of bf16): the build holds the shards
    and two gathered layers, below the step."""
    plan = next(p for p in plans if p.layout == Layout(1, 1, 128, 1, 3, "full", "parameters"))
    build, train = plan.memory.phase("build"), plan.memory.phase("train")
    assert build.part("parameters as built") == 0 and build.total < train.total
    assert train.total < 0.5 * GPU_GIB * GIB
