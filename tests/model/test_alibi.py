"""The ALiBi bias: one tensor per rank shared by every attention layer, computed in fp32 and
cast once, in the [1, heads, s, s] form SDPA's fused kernels take (that it is really applied
inside one, storing no scores, is checked by tests/training/test_activation_memory.py)."""

from __future__ import annotations

import pytest
import torch

from megatron3d.model import grouped_attention
from megatron3d.model.gpt import build_gpt, lm_loss
from megatron3d.model.positional import AlibiBias, alibi_slopes
from tests.helpers.tiny import layer_context, model_config


def test_every_layer_of_a_stage_uses_one_bias_tensor(monkeypatch):
    masks = []
    sdpa = grouped_attention.F.scaled_dot_product_attention

    def recording(*args, attn_mask=None, **kwargs):
        masks.append(attn_mask)
        return sdpa(*args, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(grouped_attention.F, "scaled_dot_product_attention", recording)
    cfg = model_config("bloom", num_layers=3)
    ctx = layer_context(cfg, dtype=torch.bfloat16)
    model = build_gpt(ctx)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1))
    lm_loss(model(tokens[:, :-1]), tokens[:, 1:], torch.ones(2, cfg.seq_length), ctx).backward()
    heads, s = cfg.num_attention_heads, cfg.seq_length
    assert len(masks) == 3
    assert all(m.shape == (1, heads, s, s) and m.dtype == torch.bfloat16 for m in masks)
    assert len({m.untyped_storage().data_ptr() for m in masks}) == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_bias_is_computed_in_fp32_and_cast_once(dtype):
    # 24 heads: slopes 2^(-k/2) that no low precision holds exactly, and the interleaved
    # extras of a head count that is not a power of two.
    slopes = alibi_slopes(24)
    s = 300
    distance = torch.arange(s, dtype=torch.float64)[None, :] - torch.arange(s)[:, None]
    exact = (slopes.double()[:, None, None] * distance).masked_fill(distance > 0,
                                                                    float("-inf"))
    bias = AlibiBias(slopes).get(s, dtype, torch.device("cpu"))
    assert bias.shape == (1, 24, s, s)
    assert torch.equal(bias[0], exact.float().to(dtype))


def test_a_shorter_sequence_gets_a_block_of_the_built_bias():
    bias = AlibiBias(alibi_slopes(4))
    full = bias.get(32, torch.float32, torch.device("cpu"))
    short = bias.get(20, torch.float32, torch.device("cpu"))
    assert short.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()
    assert torch.equal(short, AlibiBias(alibi_slopes(4)).get(20, torch.float32,
                                                              torch.device("cpu")))
