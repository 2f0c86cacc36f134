"""FLOPs per iteration: golden values from the raw per-operation formula for real models."""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction

import pytest
import torch

from megatron3d.accounting.flops import (
    FlopsCount,
    flops_per_iteration,
    layer_forward_flops_per_token,
    tflops_per_gpu,
    throughput,
)
from megatron3d.config import ModelConfig
from megatron3d.model.context import LayerContext
from megatron3d.model.transformer import TransformerLayer
from megatron3d.mpu.state import AxisGroup


def gpt2_medium(checkpoint: bool = False) -> ModelConfig:
    return ModelConfig(num_layers=24, hidden_size=1024, num_attention_heads=16,
                       seq_length=1024, vocab_size=50257, checkpoint_activations=checkpoint)


def bloom_176b(checkpoint: bool) -> ModelConfig:
    return ModelConfig(num_layers=70, hidden_size=14336, num_attention_heads=112,
                       seq_length=2048, vocab_size=250880, position_embedding_type="alibi",
                       checkpoint_activations=checkpoint)


def llama_7b(checkpoint: bool = False) -> ModelConfig:
    return ModelConfig(num_layers=32, hidden_size=4096, num_attention_heads=32,
                       ffn_hidden_size=11008, seq_length=2048, vocab_size=32000, swiglu=True,
                       normalization="rmsnorm", position_embedding_type="rope",
                       checkpoint_activations=checkpoint)


def test_gpt2_medium_golden():
    B, s, L, h, V = 512, 1024, 24, 1024, 50304
    per_token_layer = 2 * h * 3 * h + 2 * s * h + 2 * s * h + 2 * h * h + 2 * h * (4 * h) * 2
    forward = B * s * (L * per_token_layer + 2 * h * V)
    count = flops_per_iteration(gpt2_medium(), B, V)
    assert count == FlopsCount(hardware=3 * forward, model=3 * forward)
    assert count.model == 72 * B * s * L * h**2 + 12 * B * s**2 * L * h + 6 * B * s * h * V
    # about 1.27 PFLOPs: roughly 6 x 350M parameters x 524k tokens, plus attention
    assert count.model == 1_270_348_246_941_696


def test_gpt2_medium_with_checkpointing_recomputes_layers_only():
    B, s, L, h, V = 512, 1024, 24, 1024, 50304
    plain = flops_per_iteration(gpt2_medium(), B, V)
    ckpt = flops_per_iteration(gpt2_medium(checkpoint=True), B, V)
    layers_forward = B * s * L * (24 * h**2 + 4 * s * h)
    assert ckpt.model == plain.model
    assert ckpt.hardware == plain.model + layers_forward


def bigscience(c: int, *dims: int) -> Fraction:
    """24 c B s L h^2 (1 + s/(6h) + V/(16 L h)) for dims = (B, s, L, h, V), exactly."""
    B, s, L, h, V = dims
    return 24 * c * B * s * L * h**2 * (1 + Fraction(s, 6 * h) + Fraction(V, 16 * L * h))


def test_bloom_176b_with_checkpointing_equals_bigscience_formula():
    B, s, L, h, V = 2048, 2048, 70, 14336, 250880
    count = flops_per_iteration(bloom_176b(checkpoint=True), B, V)
    assert count.hardware == bigscience(4, B, s, L, h, V)
    assert count.hardware == 96 * B * s * L * h**2 + 16 * B * s**2 * L * h + 6 * B * s * h * V
    assert count.model == 72 * B * s * L * h**2 + 12 * B * s**2 * L * h + 6 * B * s * h * V


def test_bloom_176b_without_checkpointing():
    B, s, L, h, V = 2048, 2048, 70, 14336, 250880
    count = flops_per_iteration(bloom_176b(checkpoint=False), B, V)
    assert count.hardware == count.model
    assert count.model == 72 * B * s * L * h**2 + 12 * B * s**2 * L * h + 6 * B * s * h * V
    # BigScience's c=3 scales the head by 3/4: 4.5 B s h V instead of 6 B s h V.
    assert count.model - bigscience(3, B, s, L, h, V) == Fraction(3, 2) * B * s * h * V


def test_llama_7b_swiglu_counts_three_mlp_matrices():
    B, s, L, h, f, V = 2048, 2048, 32, 4096, 11008, 32000
    per_token_layer = 2 * h * 3 * h + 4 * s * h + 2 * h * h + 2 * h * f * 3
    forward = B * s * (L * per_token_layer + 2 * h * V)
    count = flops_per_iteration(llama_7b(), B, V)
    assert count == FlopsCount(hardware=3 * forward, model=3 * forward)
    # Same thing as "6 N per token" over the matmul weights N plus the attention term.
    matmul_params = L * (4 * h * h + 3 * h * f) + h * V
    assert count.model == 6 * matmul_params * B * s + 12 * L * s * h * B * s
    # about 180 PFLOPs: roughly 6 x 6.7B parameters x 4.2M tokens, plus attention
    assert count.model == 179_783_345_280_909_312


def test_llama_7b_checkpointing():
    B, s, L, h, f, V = 2048, 2048, 32, 4096, 11008, 32000
    count = flops_per_iteration(llama_7b(checkpoint=True), B, V)
    layers_forward = B * s * L * (8 * h * h + 4 * s * h + 6 * h * f)
    assert count.hardware - count.model == layers_forward


@pytest.mark.parametrize("granularity", ["full", "selective"])
def test_recompute_granularity_counts_what_is_rerun(granularity):
    """Full re-runs every layer's forward; selective only the attention core's two matmuls
    (Q K^T and probabilities x V, 2 s h each per token), on top of the model count."""
    B, s, L, h, f, V = 2048, 2048, 32, 4096, 11008, 32000
    plain = flops_per_iteration(llama_7b(), B, V)
    count = flops_per_iteration(replace(llama_7b(), recompute_granularity=granularity), B, V)
    rerun = {"full": B * s * L * (8 * h * h + 4 * s * h + 6 * h * f),
             "selective": B * s * L * 4 * s * h}[granularity]
    assert count == FlopsCount(hardware=plain.model + rerun, model=plain.model)
    if granularity == "full":  # the same as --checkpoint-activations
        assert count == flops_per_iteration(llama_7b(checkpoint=True), B, V)


def test_tflops_per_gpu():
    assert tflops_per_gpu(1e15, 2.0, 4) == pytest.approx(125.0)
    with pytest.raises(ValueError):
        tflops_per_gpu(1e15, 0.0, 4)


def test_throughput_reports_model_tflops_only_with_recompute_and_mfu_from_model():
    recomputed = throughput(FlopsCount(hardware=4 * 10**15, model=3 * 10**15), 1.0, 10, 500.0)
    assert recomputed.tflops == pytest.approx(400.0)
    assert recomputed.model_tflops == pytest.approx(300.0)
    assert recomputed.mfu_percent == pytest.approx(60.0)
    plain = throughput(FlopsCount(hardware=3 * 10**15, model=3 * 10**15), 1.0, 10, None)
    assert plain.model_tflops is None
    assert plain.mfu_percent is None


@pytest.mark.parametrize("groups", [None, 8, 1], ids=["mha", "gqa-8", "mqa"])
def test_layer_flops_are_twice_the_matrix_weights_plus_attention(groups):
    """Counted independently from the built layer: every matmul weight does 2 FLOPs per
    token, and the score and value products 2 s h each (grouped K/V heads are shared, not
    fewer products)."""
    cfg = ModelConfig(num_layers=2, hidden_size=256, num_attention_heads=32, seq_length=64,
                      vocab_size=100, position_embedding_type="rope", normalization="rmsnorm",
                      swiglu=True, disable_bias_linear=True, group_query_attention=bool(groups),
                      num_query_groups=groups)
    layer = TransformerLayer(LayerContext(cfg, AxisGroup.single(), 0,
                                          device=torch.device("meta")), 0)
    weights = sum(p.numel() for p in layer.parameters() if p.dim() == 2)
    s, h = cfg.seq_length, cfg.hidden_size
    assert layer_forward_flops_per_token(cfg) == 2 * weights + 4 * s * h
