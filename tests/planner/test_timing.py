"""The time model's pieces: the pipeline makespan against the simulator running the real
programs, the bandwidth each group gets, and a step's parts adding up."""

from __future__ import annotations

import pytest

from megatron3d.accounting.flops import flops_per_iteration
from megatron3d.accounting.placement import placement
from megatron3d.cli.arguments import parse_args
from megatron3d.pipeline.interleaved import interleaved_1f1b
from megatron3d.pipeline.schedule import schedule_for
from megatron3d.pipeline.simulate import simulate
from megatron3d.planner.hardware import NETWORK_EFFICIENCY, NVLINK_EFFICIENCY, Cluster
from megatron3d.planner.layout import Layout
from megatron3d.planner.timing import pipeline_seconds, step_time
from tests.helpers.tiny import train_argv


@pytest.mark.parametrize(("forward", "backward"), [(1, 2), (2, 7), (3, 9)])
@pytest.mark.parametrize(("schedule", "p", "m", "v"), [
    ("1f1b", 1, 4, 1), ("1f1b", 2, 1, 1), ("1f1b", 4, 3, 1), ("1f1b", 4, 16, 1),
    ("1f1b", 8, 64, 1), ("gpipe", 4, 8, 1), ("1f1b", 2, 4, 2), ("1f1b", 4, 8, 2),
    ("1f1b", 4, 12, 3), ("1f1b", 3, 3, 4)])
def test_makespan_is_the_simulators(schedule, p, m, v, forward, backward):
    programs = [interleaved_1f1b(p, r, m, v) if v > 1 else schedule_for(schedule, p, r, m)
                for r in range(p)]
    report = simulate(programs, v, forward, backward)
    assert pipeline_seconds(m, p, v, forward, backward) == report.makespan


def test_ring_bandwidth_inside_a_node_and_across():
    cluster = Cluster(4, 8, intra_node_gbps=2400, inter_node_gbps=1600)
    nvlink = 2400 / 8 * 1e9 * NVLINK_EFFICIENCY
    network = 1600 / 8 * 1e9 * NETWORK_EFFICIENCY
    assert cluster.ring_bandwidth(8, 1) == nvlink  # TP 8: one node
    assert cluster.ring_bandwidth(2, 4) == nvlink  # DP 2 over TP 4: still one node
    assert cluster.ring_bandwidth(16, 1) == network  # a node's 8 members, one group
    assert cluster.ring_bandwidth(8, 4) == network * 2 / 8  # 2 members here, 4 groups share
    assert cluster.ring_bandwidth(4, 8) == network / 8  # one member per node
    assert cluster.p2p_bandwidth(8, True) == network / 8
    assert cluster.p2p_bandwidth(2, True) == network / 2
    assert cluster.p2p_bandwidth(8, False) == nvlink


def _step(*flags: str, layout: Layout):
    cfg = layout.apply(parse_args(train_argv("gpt2", 10, "--bf16", *flags)))
    cluster = Cluster(1, layout.tp * layout.pp * layout.dp)
    return cfg, cluster, step_time(cfg, layout, placement(cfg), cluster,
                                   cfg.model.padded_vocab_size(layout.tp))


def test_a_step_adds_up_and_gives_the_logged_tflops():
    layout = Layout(2, 2, 2, 2, 1, "full", "parameters")
    cfg, cluster, time = _step(layout=layout)
    flops = flops_per_iteration(cfg.model, 8, cfg.model.padded_vocab_size(2)).hardware
    assert time.iteration_s == pytest.approx(time.pipeline_s + time.exposed_comm_s)
    assert time.pipeline_s == pytest.approx(pipeline_seconds(2, 2, 1, time.forward_s,
                                                             time.backward_s))
    assert time.tflops_per_gpu == pytest.approx(flops / (time.iteration_s * 8 * 1e12))


def test_communication_slows_a_step_down():
    alone = _step(layout=Layout(1, 1, 1, 1, 0, "none", "parameters"))[2]
    data_parallel = _step(layout=Layout(1, 1, 8, 1, 0, "none", "parameters"))[2]
    assert data_parallel.exposed_comm_s > 0 and alone.exposed_comm_s == 0
    zero3 = _step(layout=Layout(1, 1, 8, 1, 3, "none", "parameters"))[2]
    no_prefetch = _step("--zero3-prefetch-depth", "0",
                        layout=Layout(1, 1, 8, 1, 3, "none", "parameters"))[2]
    assert no_prefetch.forward_s > zero3.forward_s >= alone.forward_s
    full = _step(layout=Layout(2, 1, 4, 2, 0, "full", "parameters"))[2]
    none = _step(layout=Layout(2, 1, 4, 2, 0, "none", "parameters"))[2]
    assert full.backward_s > none.backward_s  # recompute and its all-reduces
