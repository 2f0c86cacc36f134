"""Activation memory at the paper's figures: what each layer keeps for backward, measured
with saved-tensor hooks on gloo ranks in bf16, against Korthikanti et al. 2022 and our own
exact count; the loss's peak at a (scaled-down) large vocabulary; and the memory fixes that
get there (sequence-parallel linears keep shards, no clone before the forward all-reduce)."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from megatron3d.accounting.activations import (
    PeakMemory,
    cross_entropy_peak,
    layer_activation_bytes,
    measured_layer_bytes,
    paper_layer_bytes,
    saved_bytes,
)
from megatron3d.config import ModelConfig
from megatron3d.mpu.layers import ColumnParallelLinear
from megatron3d.mpu.mappings import reduce_from_tp_region
from megatron3d.mpu.random import seeded_normal
from megatron3d.mpu.sharding import tp_shard
from megatron3d.mpu.state import AxisGroup, ParallelState
from tests.helpers.dist import run_distributed
from tests.helpers.tiny import FLAVOURS

BF16, MICRO_BATCH = torch.bfloat16, 2
# Attention dropout 0: the CPU runs SDPA's fused (flash) kernel only without it.
SHAPE = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
         "vocab_size": 203, "hidden_dropout": 0.1, "attention_dropout": 0.0}
RECOMPUTE = (None, "selective", "full")
# Grouped-query attention: 8 query heads of size 8 in 4 groups, whole groups at TP 2 and 4.
GQA = {"num_attention_heads": 8, "group_query_attention": True, "num_query_groups": 4}
MODELS = {**FLAVOURS, "gpt2-gqa": GQA, "llama-gqa": {**FLAVOURS["llama"], **GQA}}
# (model, sequence parallel, recompute) measured on every TP size.
LAYOUTS = [("gpt2", sp, rc) for sp in (False, True) for rc in RECOMPUTE] + [
    ("llama", True, "selective"), ("llama", False, None), ("bloom", True, None),
    ("gpt2-gqa", False, None), ("llama-gqa", False, None), ("llama-gqa", True, "selective")]
# The loss: a 128k vocabulary scaled down 16x (and s, b with it); 8000 pads to 8192 and
# leaves the last TP rank with padding columns.
LOSS_SEQ, LOSS_VOCABS = 64, (8192, 8000)


def _config(model: str, recompute: str | None) -> ModelConfig:
    return ModelConfig(**{**SHAPE, **MODELS[model], "recompute_granularity": recompute})


def _loss_peak(tp: AxisGroup, vocab: int) -> tuple[int, int]:
    """(peak bytes, bytes of this rank's logits in fp32) for bf16 logits [s, b, 8192/tp]."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(LOSS_SEQ, MICRO_BATCH, 8192 // tp.size, generator=gen, dtype=BF16)
    labels = torch.randint(0, vocab, (LOSS_SEQ, MICRO_BATCH), generator=gen)
    return (cross_entropy_peak(logits.requires_grad_(), labels, tp, vocab),
            4 * logits.numel())


def _column_shard_check(tp: AxisGroup) -> int:
    """A sequence-parallel column-parallel linear against F.linear on the full tensors;
    returns the bytes it saves for backward."""
    s, b, h, out = 8, 2, 16, 24
    layer = ColumnParallelLinear(h, out, tp=tp, name="col", seed=1, init_std=0.02,
                                 sequence_parallel=True)
    with torch.no_grad():
        layer.bias.copy_(tp_shard(seeded_normal((out,), 1.0, 1, "bias"), 0, tp.rank, tp.size))
    x_full = seeded_normal((s, b, h), 1.0, 1, "x").requires_grad_()
    w_full = seeded_normal((out, h), 0.02, 1, "col.weight").requires_grad_()
    b_full = seeded_normal((out,), 1.0, 1, "bias").requires_grad_()
    dy = seeded_normal((s, b, out), 1.0, 1, "dy")
    torch.nn.functional.linear(x_full, w_full, b_full).backward(dy)
    x = x_full.detach().chunk(tp.size)[tp.rank].clone().requires_grad_()  # [s/tp, b, h]
    size, y = saved_bytes(functools.partial(layer, x), [layer.weight, layer.bias])
    y.backward(tp_shard(dy, 2, tp.rank, tp.size))
    close = functools.partial(torch.testing.assert_close, rtol=1e-5, atol=1e-6)
    close(x.grad, x_full.grad.chunk(tp.size)[tp.rank])
    close(layer.weight.grad, tp_shard(w_full.grad, 0, tp.rank, tp.size))
    close(layer.bias.grad, tp_shard(b_full.grad, 0, tp.rank, tp.size))
    return size


def _reduce_peak(tp: AxisGroup) -> int:
    partial = torch.ones(64, 8, requires_grad=True) * (tp.rank + 1.0)  # a fresh result
    with PeakMemory() as peak:
        total = reduce_from_tp_region(partial, tp)
    assert torch.equal(total, torch.full((64, 8), sum(range(1, tp.size + 1)) * 1.0))
    return peak.peak


def _measure(tp_size: int) -> dict:
    tp = ParallelState.build(tp_size, 1).tp
    out: dict = {layout: measured_layer_bytes(_config(layout[0], layout[2]), MICRO_BATCH, tp,
                                              layout[1], BF16) for layout in LAYOUTS}
    out |= {("loss", vocab): _loss_peak(tp, vocab) for vocab in LOSS_VOCABS}
    out["column"] = _column_shard_check(tp)
    out["reduce"] = _reduce_peak(tp)
    return out


@pytest.fixture(scope="module")
def measured():
    """Every rank's measurements, one spawn per TP size, shared by the tests below."""
    cache: dict[int, list[dict]] = {}

    def get(tp_size: int) -> list[dict]:
        if tp_size not in cache:
            cache[tp_size] = run_distributed(_measure, tp_size, tp_size, timeout_s=300)
        return cache[tp_size]

    return get


@pytest.mark.parametrize("tp", [2, 4])
def test_selective_recompute_under_sp_keeps_at_most_the_papers_34_sbh_over_t(measured, tp):
    cfg = _config("gpt2", "selective")
    paper = 34 * cfg.seq_length * MICRO_BATCH * cfg.hidden_size / tp  # bytes, 16-bit
    assert paper == paper_layer_bytes(cfg, MICRO_BATCH, tp, sequence_parallel=True)
    for rank in measured(tp):
        for per_layer in rank[("gpt2", True, "selective")]:
            assert per_layer <= 1.05 * paper, (per_layer, paper)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp-sp"])
def test_full_recompute_keeps_only_the_layer_input(measured, tp, sp):
    rows = SHAPE["seq_length"] // tp if sp else SHAPE["seq_length"]
    layer_input = rows * MICRO_BATCH * SHAPE["hidden_size"] * BF16.itemsize
    for rank in measured(tp):
        assert rank[("gpt2", sp, "full")] == [layer_input] * SHAPE["num_layers"]


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: f"{x[0]}-sp{int(x[1])}-{x[2]}")
def test_each_layout_is_within_2_percent_of_our_count(measured, layout, tp):
    model, sp, recompute = layout
    ours = sum(layer_activation_bytes(_config(model, recompute), MICRO_BATCH, tp, sp, BF16,
                                      "cpu").values())
    for rank in measured(tp):
        for per_layer in rank[layout]:
            assert abs(per_layer / ours - 1) <= 0.02, (per_layer, ours)


def test_sequence_parallelism_and_selective_recompute_shrink_what_is_kept(measured):
    """Each step down the paper's table is real: TP+SP below TP alone, selective below none,
    full below selective."""
    rank = measured(2)[0]
    assert rank[("gpt2", True, None)][0] < rank[("gpt2", False, None)][0]
    for sp in (False, True):
        none, selective, full = (rank[("gpt2", sp, rc)][0] for rc in RECOMPUTE)
        assert full < selective < none


@pytest.mark.parametrize("vocab", LOSS_VOCABS)
@pytest.mark.parametrize("tp", [2, 4])
def test_cross_entropy_peak_is_one_and_a_half_fp32_logits(measured, tp, vocab):
    """One fp32 buffer, and in backward the bf16 gradient: 1.5x this rank's fp32 logits, plus
    fp32 vectors of one value per token: the losses it returns, and the row max, target logit
    and sum of exponentials reduced over TP, which the process group may free a little late."""
    per_token = 4 * 4 * LOSS_SEQ * MICRO_BATCH
    for rank in measured(tp):
        peak, fp32_logits = rank[("loss", vocab)]
        assert peak <= 1.5 * fp32_logits + per_token, peak / fp32_logits


def test_sequence_parallel_column_linear_keeps_only_its_input_shard(measured):
    shard = 8 // 2 * 2 * 16 * 4  # [s/tp, b, in] fp32
    assert [rank["column"] for rank in measured(2)] == [shard, shard]


def test_forward_all_reduce_makes_no_copy(measured):
    assert [rank["reduce"] for rank in measured(2)] == [0, 0]


def test_the_counts_follow_the_paper_term_for_term():
    """Ours is the paper's 34 s b h / t under SP with selective recompute (gpt2 shape, one
    byte per dropout mask), plus the norms' per-token statistics."""
    cfg = dataclasses.replace(_config("gpt2", "selective"), hidden_size=1024,
                              num_attention_heads=16, seq_length=2048)
    for tp in (1, 2, 8):
        ours = layer_activation_bytes(cfg, 4, tp, True, BF16)
        stats = 2 * 2 * 4 * 2048 * 4 // tp  # 2 norms x (mean, rstd) x fp32 x tokens
        assert sum(ours.values()) == paper_layer_bytes(cfg, 4, tp, True) + stats
