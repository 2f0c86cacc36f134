"""Context parallelism in the accounting and the planner, pinned on small cases by hand: a
layer's bytes at CP 2 for each exchange, the bytes each exchange sends, the causal work of
each rank (against a brute-force count over the real chunk layout), the states sharded over
DP x CP, the communicators, the step time, the planner's candidates and the start-up line;
and CP = 1 giving exactly what it gave before CP existed."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron3d.accounting import overheads
from megatron3d.accounting.activations import layer_activation_bytes
from megatron3d.accounting.context_parallel import (
    COMM_TYPES,
    Split,
    attention_flops,
    causal_pairs,
    exchange_bytes,
    imbalance,
)
from megatron3d.accounting.fit import format_phases, layout_memory
from megatron3d.accounting.placement import placement
from megatron3d.cli.arguments import parse_args
from megatron3d.config import ModelConfig
from megatron3d.cp.layout import rank_index
from megatron3d.planner.hardware import Cluster
from megatron3d.planner.layout import Layout
from megatron3d.planner.search import Fixed, candidates
from megatron3d.planner.timing import step_time
from tests.helpers.tiny import train_argv

BF16 = torch.bfloat16
# h 64, 4 heads of d 16, s 32, GPT-2 (LayerNorm, GeLU 4h), no dropout; micro-batch 2, bf16.
SMALL = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=32,
                    vocab_size=128, hidden_dropout=0.0, attention_dropout=0.0)


def _layer(cp: int, comm: str = "p2p", model: ModelConfig = SMALL) -> dict[str, int]:
    return layer_activation_bytes(model, 2, 1, False, BF16, "cuda", cp, comm)


def test_a_layer_at_cp_2_by_hand():
    """16 local tokens x 2 samples = 32 token rows, e = 2 bytes, h = 64, 4 heads of 16."""
    local = {"norms": 2 * (2 * 32 * 64 + 2 * 4 * 32),  # LayerNorm input, fp32 mean and rstd
             "qkv input": 2 * 32 * 64, "q, k, v": 2 * 32 * 3 * 64,
             "attention output": 2 * 32 * 64, "log-sum-exp": 4 * 2 * 4 * 16,
             "fc1 input": 2 * 32 * 64, "MLP": 2 * 32 * 256 * 2}
    assert _layer(2, "p2p") == local
    assert sum(local.values()) * 2 == sum(_layer(1).values())  # exactly half of CP = 1
    kv = 2 * 2 * 16 * 2 * 4 * 16  # one rank's K and V: e b (s/C) 2G d = 8192
    assert _layer(2, "all_gather") == {**local, "gathered keys and values": 2 * kv,
                                       "attention mask": 2 * 16 * 32}
    # a2a: its head-sharded q, k, v replace the local ones, the output is kept once; plus
    # the order of the s = 32 tokens (int64)
    assert _layer(2, "a2a") == {**local, "the tokens' order": 8 * 32}
    bloom = dataclasses.replace(SMALL, position_embedding_type="alibi")
    assert _layer(2, "all_gather", bloom)["ALiBi bias"] == 2 * 2 * 4 * 16 * 32
    assert "attention mask" not in _layer(2, "all_gather", bloom)
    selective = dataclasses.replace(SMALL, recompute_granularity="selective")
    assert "gathered keys and values" not in _layer(2, "all_gather", selective)


def test_cp_1_is_what_it_was_for_every_exchange():
    for comm in COMM_TYPES:
        assert _layer(1, comm) == layer_activation_bytes(SMALL, 2, 1, False, BF16)
        assert exchange_bytes(Split(SMALL, 2, 1, 1, comm)) == (0.0, 0.0)


def test_each_exchange_sends_by_hand():
    """C = 4, GQA with 2 groups: kv = e b (s/4) 2G d = 2 * 2 * 8 * 4 * 16 = 2048 bytes."""
    gqa = dataclasses.replace(SMALL, group_query_attention=True, num_query_groups=2)
    kv = 2048
    assert Split(gqa, 2, 1, 4).kv == kv
    # p2p backward: K/V around the ring again, then the other shards' dK/dV in fp32
    assert exchange_bytes(Split(gqa, 2, 1, 4, "p2p")) == (3 * kv, 3 * kv + 3 * 2 * kv)
    assert exchange_bytes(Split(gqa, 2, 1, 4, "all_gather")) == (3 * kv, 3 * kv)
    qkvo = 2 * 2 * 8 * (2 * 4 + 2 * 2) * 16  # q, k, v and output of the 8 local tokens
    out = 2 * 2 * 8 * 4 * 16  # the output, traded back to heads in backward (not kept)
    assert exchange_bytes(Split(gqa, 2, 1, 4, "a2a")) == (0.75 * qkvo, 0.75 * (qkvo + out))


@pytest.mark.parametrize(("seq", "cp"), [(8, 2), (32, 2), (32, 4), (64, 8)])
def test_causal_work_is_balanced_by_the_chunk_layout(seq, cp):
    """Against a brute-force count of index_j <= index_i over ``cp.layout.rank_index``."""
    brute = [int((idx.unsqueeze(1) >= torch.arange(seq).unsqueeze(0)).sum())
             for idx in (rank_index(seq, cp, r) for r in range(cp))]
    assert causal_pairs(seq, cp) == brute
    assert sum(brute) == seq * (seq + 1) // 2 and imbalance(brute) == 1.0
    contiguous = causal_pairs(seq, cp, balanced=False)
    assert sum(contiguous) == sum(brute) and imbalance(contiguous) > cp
    split = Split(dataclasses.replace(SMALL, seq_length=seq), 2, 1, cp)
    assert attention_flops(split) == [4 * 16 * 4 * 2 * p for p in brute]


def _cfg(*flags: str, world: int = 2, cp: int = 1, comm: str = "p2p"):
    cfg = parse_args(train_argv("gpt2", 10, "--bf16", "--seq-length", "32",
                                "--micro-batch-size", "2", "--global-batch-size", "4", *flags))
    parallel = dataclasses.replace(cfg.parallel, context_parallel_size=cp, cp_comm_type=comm)
    return dataclasses.replace(cfg, parallel=parallel)


def test_states_shard_over_dp_x_cp_and_activations_over_cp():
    """ZeRO-1 on 2 ranks: DP 2 and CP 2 shard the same states; CP halves what is in flight."""
    dp2 = layout_memory(_cfg("--zero-stage", "1"), 2, "cpu")[0]
    cp2 = layout_memory(_cfg("--zero-stage", "1", cp=2), 2, "cpu")[0]
    assert cp2.states == dp2.states
    in_flight = [m.phase("train").part("activations in flight") for m in (dp2, cp2)]
    # DP 2 runs 1 micro-batch of 2 samples per step, CP 2 two of 2 half-sequences:
    # per micro-batch the CP rank keeps half the DP rank's.
    assert in_flight[1] * 2 == in_flight[0]
    wire = [layout_memory(_cfg("--zero-stage", "1", "--grad-reduce-in-bf16", cp=c), 2, "cpu")[0]
            .phase("train").part("reducer bf16 copies") for c in (1, 2)]
    assert wire[0] > 0 and wire[1] == wire[0]  # the bf16 copies of a reduction over 2 ranks


def test_each_rank_pays_for_the_cp_communicators():
    groups = overheads.nccl_groups(tp=2, pp=1, dp=2, tied=True, pp_rank=0, cp=4)
    assert groups == {"world": 16, "tp": 2, "dp": 2, "cp": 4, "dp-cp": 8, "model-parallel": 2}
    assert overheads.nccl_groups(2, 1, 2, True, 0) == {"world": 4, "tp": 2, "dp": 2,
                                                      "model-parallel": 2}


def test_the_start_up_line_says_cp():
    rank = layout_memory(_cfg(cp=2, comm="a2a"), 2, "cpu")[0]
    assert "context-parallel 2 (a2a): 1/2 of each sequence" in format_phases(rank, 0, 2, "a2a")
    assert "context-parallel" not in format_phases(rank, 0)


def _step(layout: Layout, seq: int = 32):
    cfg = _cfg()
    cfg = layout.apply(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model,
                                                                          seq_length=seq)))
    cluster = Cluster(1, layout.tp * layout.cp * layout.pp * layout.dp)
    return step_time(cfg, layout, placement(cfg), cluster, cfg.model.padded_vocab_size(1))


def _cp(cp: int, comm: str = "p2p", recompute: str = "none") -> Layout:
    return Layout(1, 1, 1, 2, 0, recompute, "parameters", cp=cp, cp_comm_type=comm)


def test_cp_costs_its_exchange_and_the_ring_hides_behind_attention():
    """Half the tokens per micro-batch, the exchange on top: on a tiny layer it shows; at
    64k tokens the ring hides behind the attention of the chunk in hand, all-gather not."""
    alone = _step(_cp(1))
    assert _step(Layout(1, 1, 1, 2, 0, "none", "parameters")) == alone  # CP 1: as before
    for comm in COMM_TYPES:
        assert _step(_cp(2, comm)).forward_s > alone.forward_s / 2
    assert _step(_cp(2, "p2p", "full")).backward_s > _step(_cp(2, "p2p")).backward_s
    long = _step(_cp(1), 65536)
    ring, gather = _step(_cp(2, "p2p"), 65536), _step(_cp(2, "all_gather"), 65536)
    assert ring.forward_s == pytest.approx(long.forward_s / 2)
    assert ring.backward_s == pytest.approx(long.backward_s / 2)
    assert gather.forward_s > ring.forward_s


def test_the_planner_searches_cp_for_long_sequences_only():
    short = candidates(8, 4, 8, Fixed(tp=1, pp=1, micro_batch_size=1), seq_length=4096)
    long = candidates(8, 4, 8, Fixed(tp=1, pp=1, micro_batch_size=1), seq_length=8192)
    assert {layout.cp for layout in short} == {1}
    assert {layout.cp for layout in long} == {1, 2, 4, 8}
    assert {(c.cp, c.dp) for c in long} == {(1, 8), (2, 4), (4, 2), (8, 1)}
    fixed = candidates(8, 4, 8, Fixed(tp=1, pp=1, cp=2, cp_comm_type="a2a"), seq_length=64)
    assert {(c.cp, c.cp_comm_type) for c in fixed} == {(2, "a2a")}
    assert "--context-parallel-size 2 --cp-comm-type a2a" in fixed[0].flags()
