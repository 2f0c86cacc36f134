"""Weight-decay groups come from parameter metadata, whatever class made the parameter."""

from __future__ import annotations

import torch

from megatron3d.model.gpt import gpt_layer_specs
from megatron3d.mpu.meta import get_meta
from megatron3d.optim.optimizer import format_param_groups, param_groups
from megatron3d.pipeline.spec import LayerSpec, build_stage
from tests.helpers.flat import whole
from tests.helpers.tiny import layer_context, model_config


def _whole(model):
    buffers, shard = whole(list(model.parameters()))
    return buffers, shard, lambda start, end, local: buffers.params[start:end]


def _groups(model):
    _, shard, master = _whole(model)
    groups = param_groups(shard, master, weight_decay=0.1)
    decay = {n for g in groups if g["weight_decay"] for n in g["names"]}
    no_decay = {n for g in groups if not g["weight_decay"] for n in g["names"]}
    return groups, decay, no_decay


def test_biases_and_norm_weights_get_no_decay():
    ctx = layer_context(model_config("bloom"))
    specs = gpt_layer_specs(ctx)
    model = build_stage(specs, 0, len(specs))
    groups, decay, no_decay = _groups(model)
    assert "embedding.norm.weight" in no_decay and "embedding.norm.bias" in no_decay
    assert all(n.endswith(".bias") or "norm" in n for n in no_decay)
    assert all(n.endswith(".weight") and "norm" not in n for n in decay)
    assert len(decay) + len(no_decay) == len(list(model.parameters()))
    table = format_param_groups(groups, 0.1)
    assert "weight_decay=0.1" in table and "layers.1.input_norm.weight" in table


def test_a_torch_layernorm_after_the_embedding_gets_no_decay():
    """BLOOM's embedding LayerNorm as a plain torch.nn.LayerNorm (no megatron3d metadata)."""
    ctx = layer_context(model_config("gpt2"))
    specs = gpt_layer_specs(ctx)
    specs.insert(1, LayerSpec(torch.nn.LayerNorm, {"normalized_shape": ctx.cfg.hidden_size}))
    model = build_stage(specs, 0, len(specs))
    names = [get_meta(p).name for p in model.layers[1].parameters()]
    assert names == ["layernorm1.weight", "layernorm1.bias"]
    _, decay, no_decay = _groups(model)
    assert {"layernorm1.weight", "layernorm1.bias"} <= no_decay
    assert not any(n.startswith("layernorm") for n in decay)


def test_decay_is_applied_only_to_the_decay_group():
    ctx = layer_context(model_config("gpt2"))
    specs = gpt_layer_specs(ctx)
    model = build_stage(specs, 0, len(specs))
    buffers, shard, master = _whole(model)
    groups = param_groups(shard, master, weight_decay=0.5)
    opt = torch.optim.AdamW(groups, lr=0.1)
    before = buffers.params.clone()
    buffers.zero_grad()  # zero gradients: only weight decay moves parameters
    opt.step()
    for seg in buffers.layout.segments:
        moved = not torch.equal(before[seg.start:seg.end], buffers.params[seg.start:seg.end])
        assert moved == (not seg.no_weight_decay)
