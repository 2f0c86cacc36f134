"""Hugging Face transformers <-> megatron3d: tensor names and layouts, one tensor at a time.

Tensors go one at a time (callers stream them), as logical fp32 tensors on both sides: our
names and layouts (see ``model/``) against those of the transformers class
``mapping.flavour_of`` names:

- GPT-2's ``Conv1D`` stores weights as [in, out] (ours are [out, in]) and its fused QKV as
  [q heads | k heads | v heads]; ours is per head [n, 3, d].
- BLOOM's fused QKV is per head [n, 3, d], as ours.
- Llama (and Mistral, and Qwen2 with its q/k/v biases) has separate q/k/v; ours is per query
  group [G, n/G + 2, d], biases as weights. Its gate and up projections are stacked
  [gate; up] in our ``fc1``. Both use the rotate-half RoPE.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator

import torch

from megatron3d.config import ModelConfig
from megatron3d.convert.hf.mapping import flavour_of

_GPT2_CONV1D = {"attention.dense": "attn.c_proj", "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj"}
_LLAMA_LAYOUT = ("llama", "qwen2")
Tensors = Iterator[tuple[str, torch.Tensor]]


def _prefixes(flavour: str) -> dict[str, str]:
    """Our name -> theirs for tensors that only move (no layout change), per layer or not."""
    if flavour == "gpt2":
        return {"embedding.word_embeddings.weight": "transformer.wte.weight",
                "embedding.position_embeddings.weight": "transformer.wpe.weight",
                "final_norm": "transformer.ln_f", "input_norm": "ln_1",
                "post_attention_norm": "ln_2", "layers": "transformer.h"}
    if flavour == "bloom":
        return {"embedding.word_embeddings.weight": "transformer.word_embeddings.weight",
                "embedding.norm": "transformer.word_embeddings_layernorm",
                "final_norm": "transformer.ln_f", "input_norm": "input_layernorm",
                "post_attention_norm": "post_attention_layernorm", "layers": "transformer.h",
                "attention.qkv": "self_attention.query_key_value",
                "attention.dense": "self_attention.dense", "mlp.fc1": "mlp.dense_h_to_4h",
                "mlp.fc2": "mlp.dense_4h_to_h"}
    return {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
            "final_norm": "model.norm", "input_norm": "input_layernorm",
            "post_attention_norm": "post_attention_layernorm", "layers": "model.layers",
            "attention.dense": "self_attn.o_proj", "mlp.fc2": "mlp.down_proj",
            "output_layer.weight": "lm_head.weight"}


def hf_name(flavour: str, name: str) -> str:
    """Their name of one of our tensors that maps one to one."""
    table = _prefixes(flavour)
    if name in table:
        return table[name]
    if name.startswith("layers."):
        _, index, rest = name.split(".", 2)
        module, _, leaf = rest.rpartition(".")
        return f"{table['layers']}.{index}.{table.get(module, module)}.{leaf}"
    module, _, leaf = name.rpartition(".")
    return f"{table[module]}.{leaf}"


def pieces_by_layer(names: list[str]) -> list[list[str]]:
    """Our logical names grouped so that one group is in memory at a time when converting:
    the embeddings, final norm and head first, then one group per transformer layer."""
    groups: dict[int, list[str]] = defaultdict(list)
    for name in names:
        groups[int(name.split(".")[1]) + 1 if name.startswith("layers.") else 0].append(name)
    return [groups[k] for k in sorted(groups)]


def to_hf(m: ModelConfig, name: str, tensor: torch.Tensor) -> Tensors:
    """Their tensors for our logical tensor ``name`` (one, or q/k/v and gate/up apart)."""
    flavour = flavour_of(m)
    leaf = name.rsplit(".", 1)[-1]
    layer = name.rsplit(".", 2)[0]  # "layers.3.attention"
    if flavour == "gpt2":
        if ".attention.qkv." in name:  # per head [n, 3, d] -> [3, n, d]; Conv1D [in, out]
            moved = _per_head_to_stacked(tensor, m.num_attention_heads)
            yield f"{_gpt2_layer(layer)}.attn.c_attn.{leaf}", _conv1d(moved)
            return
        for ours, theirs in _GPT2_CONV1D.items():
            if f".{ours}." in name:
                yield f"{_gpt2_layer(layer)}.{theirs}.{leaf}", _conv1d(tensor)
                return
    if flavour in _LLAMA_LAYOUT:
        if ".attention.qkv." in name:
            base = f"{_llama_layer(layer)}.self_attn"
            yield from ((f"{base}.{p}_proj.{leaf}", t)
                        for p, t in zip("qkv", _split_groups(tensor, m), strict=True))
            return
        if ".mlp.fc1." in name:
            gate, up = tensor.chunk(2, dim=0)
            base = f"{_llama_layer(layer)}.mlp"
            yield from ((f"{base}.gate_proj.weight", gate), (f"{base}.up_proj.weight", up))
            return
    yield hf_name(flavour, name), tensor.contiguous()


def _gpt2_layer(layer: str) -> str:
    return f"transformer.h.{layer.split('.')[1]}"


def _llama_layer(layer: str) -> str:
    return f"model.layers.{layer.split('.')[1]}"


def _conv1d(t: torch.Tensor) -> torch.Tensor:
    """GPT-2's Conv1D weight is [in, out]; a bias stays as it is."""
    return t.t().contiguous() if t.dim() == 2 else t.contiguous()


def _per_head_to_stacked(t: torch.Tensor, heads: int) -> torch.Tensor:
    rest = t.shape[1:]
    return t.reshape(heads, 3, -1, *rest).transpose(0, 1).reshape(t.shape)


def _stacked_to_per_head(t: torch.Tensor, heads: int) -> torch.Tensor:
    rest = t.shape[1:]
    return t.reshape(3, heads, -1, *rest).transpose(0, 1).reshape(t.shape)


def _split_groups(t: torch.Tensor, m: ModelConfig) -> tuple[torch.Tensor, ...]:
    """Our fused [G, n/G + 2, d] rows (of a weight [., h] or a bias) -> q, k and v."""
    groups, d, rest = m.query_groups, m.head_dim, t.shape[1:]
    per = m.num_attention_heads // groups
    q, k, v = t.reshape(groups, per + 2, d, *rest).split([per, 1, 1], dim=1)
    return tuple(x.reshape(-1, *rest).contiguous() for x in (q, k, v))


def _join_groups(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 m: ModelConfig) -> torch.Tensor:
    groups, d, rest = m.query_groups, m.head_dim, q.shape[1:]
    per = m.num_attention_heads // groups
    return torch.cat([q.reshape(groups, per, d, *rest), k.reshape(groups, 1, d, *rest),
                      v.reshape(groups, 1, d, *rest)], dim=1).reshape(-1, *rest)


def from_hf(m: ModelConfig, names: list[str], get: Callable[[str], torch.Tensor]) -> Tensors:
    """Our logical tensors ``names`` from their tensors, read through ``get`` one at a time."""
    flavour = flavour_of(m)
    for name in names:
        leaf = name.rsplit(".", 1)[-1]
        layer = name.rsplit(".", 2)[0]
        if flavour == "gpt2" and ".attention.qkv." in name:
            stacked = _conv1d(get(f"{_gpt2_layer(layer)}.attn.c_attn.{leaf}"))
            yield name, _stacked_to_per_head(stacked, m.num_attention_heads).contiguous()
        elif flavour == "gpt2" and any(f".{p}." in name for p in _GPT2_CONV1D):
            theirs = _GPT2_CONV1D[name.split(".", 2)[2].rsplit(".", 1)[0]]
            yield name, _conv1d(get(f"{_gpt2_layer(layer)}.{theirs}.{leaf}"))
        elif flavour in _LLAMA_LAYOUT and ".attention.qkv." in name:
            base = f"{_llama_layer(layer)}.self_attn"
            yield name, _join_groups(*(get(f"{base}.{p}_proj.{leaf}") for p in "qkv"), m)
        elif flavour in _LLAMA_LAYOUT and ".mlp.fc1." in name:
            base = f"{_llama_layer(layer)}.mlp"
            yield name, torch.cat([get(f"{base}.gate_proj.weight"),
                                   get(f"{base}.up_proj.weight")])
        else:
            yield name, get(hf_name(flavour, name)).contiguous()
