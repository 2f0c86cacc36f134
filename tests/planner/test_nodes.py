"""ZeRO-3's bytes across nodes per step, by hand: 2 nodes x 2 replicas, an fp32 stage of N
parameters, M micro-batches, each unit gathered for every forward and backward.

Flat (over D = 4): a gather brings the chunk N/4 from each of the 2 members elsewhere: 2N
bytes (fp32); a reduce-scatter the same of the fp32 gradients; a step gathers 2M times and
reduces M times: 6MN bytes = 1.5 * M * N * 4.
hpZ: the first gather of a step brings the primary slices (N/4) from the 1 member elsewhere: N;
each reduction's inter hop 1/2 of the N/2 chunk from it: N per reduction; (1 + M) N in all,
(1 + M) / (6M) of flat. Hybrid: one all-reduce of the N/2 shard gradients over 2 nodes:
twice half of it, 2N. Quantized: 1 + 4/256 bytes an element instead of 4.
"""

from __future__ import annotations

import dataclasses

import pytest

from megatron3d.accounting.nodes import QUANTIZED_BYTES, Nodes, received, zero3_collectives
from megatron3d.config import ParallelConfig

N = 1024 * 1024
TWO_BY_TWO = Nodes(count=2, per_node=2)
Q = (1 + 4 / 256) / 4


def _parallel(**flags: object) -> ParallelConfig:
    return dataclasses.replace(ParallelConfig(), zero_stage=3, **flags)


FLAT = _parallel()
HPZ = _parallel(zero3_secondary_shard="node")
HYBRID = _parallel(zero3_shard_group="node")
BOTH = {"zero3_quantize_weights": True, "zero3_quantize_grads": True}


def _across(parallel: ParallelConfig, micro_batches: int, nodes: Nodes = TWO_BY_TWO) -> float:
    return received(zero3_collectives(N, parallel, nodes, micro_batches, 4), nodes).inter


@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_cross_node_bytes_per_step_by_hand(m):
    assert _across(FLAT, m) == 6 * m * N == 1.5 * m * N * 4
    assert _across(HPZ, m) == (1 + m) * N
    assert _across(HYBRID, m) == 2 * N
    assert _across(HPZ, m) / _across(FLAT, m) == pytest.approx((1 + m) / (6 * m))
    assert _across(_parallel(zero3_secondary_shard="node", **BOTH), m) == pytest.approx(
        (1 + m) * N * Q)
    assert _across(_parallel(**BOTH), m) == pytest.approx(6 * m * N * Q)
    assert _across(_parallel(zero3_shard_group="node", zero3_quantize_grads=True), m) == \
        pytest.approx(2 * N * Q)


def test_the_acceptance_ratios_at_one_micro_batch():
    flat = _across(FLAT, 1)
    assert _across(HPZ, 1) / flat == pytest.approx(1 / 3)
    assert _across(HPZ, 1) / flat <= 0.35
    quantized = _across(_parallel(zero3_secondary_shard="node", **BOTH), 1) / flat
    assert quantized == pytest.approx(Q / 3) and quantized <= 0.15
    assert QUANTIZED_BYTES == 1 + 4 / 256


def test_gathers_kept_for_the_step_and_bytes_inside_the_node():
    kept = {"zero3_reshard_after_forward": "false"}
    # one gather and one reduction a step: flat 2N + 2N, hpZ N + N
    assert _across(_parallel(**kept), 4) == 4 * N
    assert _across(_parallel(zero3_secondary_shard="node", **kept), 4) == 2 * N
    intra = received(zero3_collectives(N, HPZ, TWO_BY_TWO, 1, 4), TWO_BY_TWO).intra
    # two intra gathers (N/2 of fp32 from the one neighbour) and one intra reduce-scatter
    assert intra == 3 * 2 * N
    flat = received(zero3_collectives(N, FLAT, TWO_BY_TWO, 1, 4), TWO_BY_TWO)
    assert flat.intra == 3 * N  # a quarter of N fp32 from the neighbour, three times


def test_one_node_crosses_nothing_and_more_nodes_cross_more():
    one = Nodes(count=1, per_node=4)
    assert _across(FLAT, 2, one) == 0
    four = Nodes(count=4, per_node=2)  # D = 8: a flat gather brings 6/8 N fp32
    assert _across(FLAT, 1, four) == 3 * 6 / 8 * N * 4
    assert _across(HYBRID, 1, four) == 2 * (N / 2 / 4) * 3 * 4
