"""Weight names: megatron3d's logical names <-> each peer's.

No tensor layout changes: the plain GPT-2 and Megatron-Core's GPTModel store Linear weights
[out, in] and lay out the fused QKV per head ([q, k, v] of head 0, then head 1, ...), as
megatron3d does. Both tie the output layer to the word embedding; a stage that holds the head
without the embedding holds a copy, which gets the embedding's tensor.
"""

from __future__ import annotations

import re

import torch

_TORCH_GPT2 = (  # (megatron3d pattern, plain GPT-2 pattern); {} is the layer number
    ("embedding.word_embeddings.weight", "wte.weight"),
    ("embedding.position_embeddings.weight", "wpe.weight"),
    ("layers.{}.input_norm.", "blocks.{}.ln1."),
    ("layers.{}.attention.qkv.", "blocks.{}.attn.qkv."),
    ("layers.{}.attention.dense.", "blocks.{}.attn.proj."),
    ("layers.{}.post_attention_norm.", "blocks.{}.ln2."),
    ("layers.{}.mlp.fc1.", "blocks.{}.mlp.fc1."),
    ("layers.{}.mlp.fc2.", "blocks.{}.mlp.fc2."),
    ("final_norm.", "ln_f."),
)
_MCORE = (  # (megatron3d pattern, GPTModel pattern); {} is the layer number
    ("embedding.word_embeddings.weight", "embedding.word_embeddings.weight"),
    ("embedding.position_embeddings.weight", "embedding.position_embeddings.weight"),
    ("layers.{}.input_norm.", "decoder.layers.{}.input_layernorm."),
    ("layers.{}.attention.qkv.", "decoder.layers.{}.self_attention.linear_qkv."),
    ("layers.{}.attention.dense.", "decoder.layers.{}.self_attention.linear_proj."),
    ("layers.{}.post_attention_norm.", "decoder.layers.{}.pre_mlp_layernorm."),
    ("layers.{}.mlp.fc1.", "decoder.layers.{}.mlp.linear_fc1."),
    ("layers.{}.mlp.fc2.", "decoder.layers.{}.mlp.linear_fc2."),
    ("final_norm.", "decoder.final_layernorm."),
)
MCORE_HEAD = "output_layer.weight"
"""GPTModel's output layer on a last pipeline stage without the embedding: a tied copy."""
TIED_HEAD = "head.weight"
"""The plain GPT-2's output layer: a copy (or the same tensor) of the word embedding."""


def _rename(name: str, pairs: tuple[tuple[str, str], ...], shift: int = 0) -> str:
    """``name`` through the first (source, target) pattern pair that matches it; the layer
    number, if any, moves by ``shift``."""
    for src, dst in pairs:
        pattern = "^" + re.escape(src).replace(r"\{\}", r"(\d+)")
        match = re.match(pattern, name)
        if match:
            layer = [int(n) + shift for n in match.groups()]
            return dst.format(*layer) + name[match.end():]
    raise KeyError(f"no mapping for weight {name!r}")


def torch_gpt2_name(megatron3d_name: str) -> str:
    return _rename(megatron3d_name, _TORCH_GPT2)


def to_torch_gpt2(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The plain GPT-2's whole state dict from megatron3d's logical weights."""
    state = {torch_gpt2_name(k): v for k, v in weights.items()}
    state[TIED_HEAD] = weights["embedding.word_embeddings.weight"]
    return state


def stage_state(model_keys: list[str], weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The entries of ``to_torch_gpt2(weights)`` that a (stage) module with ``model_keys``
    holds, copied: each rank's optimizer then owns its tensors."""
    full = to_torch_gpt2(weights)
    return {k: full[k].clone() for k in model_keys}


def mcore_name(megatron3d_name: str, layer_offset: int = 0) -> str:
    """GPTModel's name on a model chunk whose first layer is ``layer_offset`` (its layers
    are numbered from 0 in each chunk)."""
    return _rename(megatron3d_name, _MCORE, -layer_offset)


def megatron3d_name_of_mcore(name: str, layer_offset: int = 0) -> str:
    if name == MCORE_HEAD:
        return "embedding.word_embeddings.weight"
    return _rename(name, tuple((b, a) for a, b in _MCORE), layer_offset)
