"""Each model flavour: shapes, gradients, initial loss, tying, padding and recompute."""

from __future__ import annotations

import math

import pytest
import torch

from megatron3d.model.embedding import InputEmbedding, OutputEmbedding
from megatron3d.model.gpt import build_gpt, gpt_layer_specs, lm_loss
from megatron3d.mpu.meta import get_meta
from megatron3d.pipeline.spec import build_stage
from tests.helpers.tiny import FLAVOURS, layer_context, model_config, replace


def _batch(cfg, b=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (b, cfg.seq_length + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:], torch.ones(b, cfg.seq_length)


def _loss_and_grads(ctx, seed=0):
    model = build_gpt(ctx)
    tokens, labels, mask = _batch(ctx.cfg, seed=seed)
    loss = lm_loss(model(tokens), labels, mask, ctx)
    loss.backward()
    grads = {get_meta(p).name: p.grad.clone() for p in model.parameters()}
    return model, loss.detach(), grads


@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
def test_forward_backward(flavour):
    ctx = layer_context(model_config(flavour))
    model, loss, grads = _loss_and_grads(ctx)
    tokens, _, _ = _batch(ctx.cfg)
    logits = model(tokens)
    assert logits.shape == (ctx.cfg.seq_length, 3, ctx.padded_vocab_size)
    # Small init: the first loss is close to uniform over the logical vocabulary.
    assert abs(loss.item() - math.log(ctx.cfg.vocab_size)) < 0.1
    for name, g in grads.items():
        assert torch.isfinite(g).all(), name
        if "position" not in name and "word_embeddings" not in name:
            assert g.abs().sum() > 0, f"{name} got no gradient"


def test_flavour_structure():
    gpt2 = build_gpt(layer_context(model_config("gpt2")))
    llama = build_gpt(layer_context(model_config("llama")))
    bloom_specs = gpt_layer_specs(layer_context(model_config("bloom")))
    names = lambda m: {get_meta(p).name for p in m.parameters()}  # noqa: E731
    assert "embedding.position_embeddings.weight" in names(gpt2)
    assert not any(n.endswith(".bias") for n in names(llama)), "Llama-style has no biases"
    assert "output_layer.weight" in names(llama)
    assert [s.type_name for s in bloom_specs][:3] == ["InputEmbedding", "InputNorm",
                                                      "TransformerLayer"]
    assert bloom_specs[-1].type_name == "OutputEmbedding"


def test_tied_embeddings_share_one_parameter():
    tied = build_gpt(layer_context(model_config("gpt2")))
    inp = next(m for m in tied.layers if isinstance(m, InputEmbedding))
    out = next(m for m in tied.layers if isinstance(m, OutputEmbedding))
    assert out.weight is inp.word_embeddings.weight
    untied = build_gpt(layer_context(model_config("llama")))
    inp = next(m for m in untied.layers if isinstance(m, InputEmbedding))
    out = next(m for m in untied.layers if isinstance(m, OutputEmbedding))
    assert out.weight is not inp.word_embeddings.weight


def test_megatron_init_scales_output_projections():
    cfg = model_config("gpt2", hidden_size=64, num_layers=8, init_method_std=0.02)
    layer = build_gpt(layer_context(cfg)).layers[1]
    qkv_std = layer.attention.qkv.weight.std().item()
    dense_std = layer.attention.dense.weight.std().item()
    assert qkv_std == pytest.approx(0.02, rel=0.05)
    assert dense_std == pytest.approx(0.02 / math.sqrt(2 * 8), rel=0.05)
    assert torch.equal(layer.input_norm.weight, torch.ones(64))


@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
def test_vocab_padding_does_not_change_the_model(flavour):
    """Padding rows start at zero and are masked, so any padding gives the same loss."""
    shape = {"hidden_size": 28, "num_attention_heads": 2}  # h not a multiple of 16
    small = layer_context(model_config(flavour, **shape, make_vocab_size_divisible_by=1))
    big = layer_context(model_config(flavour, **shape, make_vocab_size_divisible_by=128))
    assert small.padded_vocab_size == 203 and big.padded_vocab_size == 256
    _, loss_small, grads_small = _loss_and_grads(small)
    _, loss_big, grads_big = _loss_and_grads(big)
    assert torch.equal(loss_small, loss_big)
    for name, g in grads_small.items():
        torch.testing.assert_close(grads_big[name][: g.shape[0]], g, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
def test_activation_checkpointing_gives_the_same_gradients(flavour):
    cfg = model_config(flavour, hidden_dropout=0.1, attention_dropout=0.1)
    torch.manual_seed(7)
    _, loss, grads = _loss_and_grads(layer_context(cfg))
    torch.manual_seed(7)
    _, loss_rc, grads_rc = _loss_and_grads(layer_context(replace(cfg,
                                                                 checkpoint_activations=True)))
    assert torch.equal(loss, loss_rc)
    for name, g in grads.items():
        torch.testing.assert_close(grads_rc[name], g, rtol=0, atol=0)


def test_a_stage_built_alone_starts_identical_to_the_full_model():
    """Initialisation depends only on the seed and logical names, not on what else is built."""
    ctx = layer_context(model_config("gpt2", num_layers=4))
    specs = gpt_layer_specs(ctx)
    full = {get_meta(p).name: p for p in build_stage(specs, 0, len(specs)).parameters()}
    stage = list(build_stage(specs, 2, 4).parameters())
    assert stage
    for p in stage:
        assert torch.equal(p, full[get_meta(p).name]), get_meta(p).name
    other_seed = build_gpt(layer_context(model_config("gpt2", num_layers=4), seed=2))
    name = "layers.0.attention.qkv.weight"
    assert not torch.equal(full[name], next(p for p in other_seed.parameters()
                                            if get_meta(p).name == name))
