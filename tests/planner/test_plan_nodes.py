"""The planner's ZeRO-3 across nodes, by hand: the tiny GPT-2 (hidden 32, 2 layers, vocabulary
padded to 208, 16 positions: 6656 + 512 + 2 x 12704 + 64 = 32640 fp32 parameters, every ZeRO-3
unit a multiple of 4) on 2 nodes x 2 GPUs, one micro-batch of each of 4 replicas a step."""

from __future__ import annotations

import dataclasses

import pytest

from megatron3d.accounting.nodes import Nodes, replica_nodes
from megatron3d.cli.arguments import parse_args
from megatron3d.config import ParallelConfig
from megatron3d.errors import ConfigError
from megatron3d.planner.hardware import NETWORK_EFFICIENCY, NVLINK_EFFICIENCY, Cluster
from megatron3d.planner.layout import Layout
from megatron3d.planner.search import Fixed, Planner, candidates
from tests.helpers.tiny import train_argv

N = 32640
CLUSTER = Cluster(2, 2, gpu_memory_gb=1e6, intra_node_gbps=400, inter_node_gbps=2)
NVLINK = 400 / 8 * 1e9 * NVLINK_EFFICIENCY
NETWORK = 2 / 8 * 1e9 * NETWORK_EFFICIENCY  # a node's; each of its 2 ranks gets half


def _plans(*flags: str):
    planner = Planner(parse_args(train_argv("gpt2", 10, "--zero3-prefetch-depth", "0",
                                            *flags)), CLUSTER)
    return {mode: planner.judge(Layout(1, 1, 4, 2, 3, "none", "uniform", zero3_mode=mode))
            for mode in ("flat", "hybrid", "secondary")}


def test_replicas_on_nodes_follow_the_rank_order():
    tp2 = dataclasses.replace(ParallelConfig(), tensor_model_parallel_size=2)
    assert replica_nodes(tp2, 4, 4) == Nodes(count=2, per_node=2)  # TP pairs, 2 per node
    cp2 = dataclasses.replace(ParallelConfig(), context_parallel_size=2)
    assert replica_nodes(cp2, 4, 2) == Nodes(count=2, per_node=2)  # DP x CP replicas
    assert replica_nodes(ParallelConfig(), 8, 8) == Nodes(count=1, per_node=8)
    pp2 = dataclasses.replace(ParallelConfig(), pipeline_model_parallel_size=2)
    with pytest.raises(ConfigError, match="unevenly"):
        replica_nodes(pp2, 3, 2)  # ranks 0-2 and 3-5 on nodes of 2


def test_memory_hybrid_keeps_states_over_the_node_and_secondary_adds_a_node_copy():
    plans = _plans()
    flat, hybrid, secondary = (plans[m].memory.states for m in ("flat", "hybrid",
                                                                "secondary"))
    assert all(plan.feasible for plan in plans.values())
    # shards of N/4 (flat) and N/2 (hybrid): fp32 parameter, gradient and two Adam moments
    assert hybrid.params - flat.params == 4 * (N // 2 - N // 4)
    assert hybrid.grads - flat.grads == 4 * (N // 2 - N // 4)
    assert hybrid.optimizer_state - flat.optimizer_state == 2 * 4 * (N // 2 - N // 4)
    # the secondary shard: N/2 in the model dtype, nothing else
    assert secondary.params - flat.params == 4 * N // 2
    assert (secondary.grads, secondary.optimizer_state) == (flat.grads, flat.optimizer_state)


def test_time_and_bytes_across_nodes_split_by_group():
    plans = _plans()
    flat, hybrid, secondary = (plans[m].time for m in ("flat", "hybrid", "secondary"))
    flat_gather = 3 / 4 * N * 4 / NETWORK  # ring of 4 over 2 nodes: the node's network
    node_gather = 1 / 2 * N * 4 / NVLINK  # ring of 2 in the node
    inter_gather = 1 / 2 * (N / 2 * 4) / (NETWORK / 2)  # 2 nodes, the rank's half of a link
    assert flat.forward_s - hybrid.forward_s == pytest.approx(flat_gather - node_gather)
    assert secondary.forward_s - hybrid.forward_s == pytest.approx(inter_gather)
    # the hybrid's all-reduce of the N/2 shard gradients across the nodes, after the step
    assert hybrid.exposed_comm_s == pytest.approx(2 * 1 / 2 * (N / 2 * 4) / (NETWORK / 2))
    assert flat.exposed_comm_s == 0
    assert flat.cross_node_bytes == 6 * N  # 1.5 x M x N x 4, M = 1
    assert hybrid.cross_node_bytes == secondary.cross_node_bytes == 2 * N


def test_node_modes_are_searched_when_the_replicas_span_nodes():
    on_two = candidates(4, 6, 2, Fixed(tp=1, pp=1, micro_batch_size=2, recompute="none",
                                       partition_method="uniform"))
    assert sorted(lay.zero3_mode for lay in on_two if lay.zero_stage == 3) == [
        "flat", "hybrid", "secondary"]
    on_one = candidates(4, 6, 4, Fixed(tp=1, pp=1, micro_batch_size=2, recompute="none",
                                       partition_method="uniform"))
    assert [lay.zero3_mode for lay in on_one if lay.zero_stage == 3] == ["flat"]
    assert Layout(1, 1, 4, 2, 3, "none", "uniform", zero3_mode="secondary").flags().endswith(
        "--zero3-secondary-shard node")
