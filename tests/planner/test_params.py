"""The planner's parameter count equals the model's as built, for every flavour: GPT-2,
BLOOM, Llama (untied, SwiGLU, no biases, RMSNorm), grouped-query attention, a given MLP
width, and a vocabulary that needs padding. The planner counts on the meta device; here the
model is built with real tensors on the CPU."""

from __future__ import annotations

import pytest
import torch

from megatron3d.model.context import LayerContext
from megatron3d.model.gpt import build_gpt
from megatron3d.mpu.state import AxisGroup
from megatron3d.planner.report import model_parameters
from tests.helpers.tiny import model_config

FLAVOURS = {
    "gpt2": ("gpt2", {}),
    "bloom": ("bloom", {}),
    "llama": ("llama", {}),
    "llama gqa": ("llama", {"group_query_attention": True, "num_query_groups": 2}),
    "gpt2 untied, ffn 72": ("gpt2", {"untie_embeddings_and_output_weights": True,
                                     "ffn_hidden_size": 72}),
    "gqa, one group, tied": ("gpt2", {"group_query_attention": True, "num_query_groups": 1}),
    "swiglu with biases": ("gpt2", {"swiglu": True, "num_layers": 3}),
}


@pytest.mark.parametrize(("flavour", "overrides"), FLAVOURS.values(), ids=FLAVOURS.keys())
def test_parameter_count_equals_the_built_model(flavour, overrides):
    cfg = model_config(flavour, **overrides)
    model = build_gpt(LayerContext(cfg, AxisGroup.single(), 1, torch.float32,
                                   torch.device("cpu")))
    assert model_parameters(cfg) == sum(p.numel() for p in model.parameters())


def test_bloom_176b_has_its_published_size():
    """BLOOM's 176,247M parameters (bigscience/bloom model card) with its 250,880-row
    embedding."""
    cfg = model_config("bloom", num_layers=70, hidden_size=14336, num_attention_heads=112,
                       seq_length=2048, vocab_size=250880, make_vocab_size_divisible_by=128)
    assert round(model_parameters(cfg) / 1e6) == 176_247
