"""Hugging Face transformers <-> megatron3d: architecture, config and tensor layouts.

One model flavour maps to one transformers class: GPT-2 (learned positions, LayerNorm, GeLU,
tied head) to ``GPT2LMHeadModel``, BLOOM (ALiBi, embedding LayerNorm) to ``BloomForCausalLM``,
Llama-style (RoPE, RMSNorm, SwiGLU, no biases, grouped-query attention) to
``LlamaForCausalLM``. Tensors go one at a time (callers stream them), as logical fp32 tensors
on both sides: our names and layouts (see ``model/``) against transformers' names and layouts:

- GPT-2's ``Conv1D`` stores weights as [in, out] (ours are [out, in]) and its fused QKV as
  [q heads | k heads | v heads]; ours is per head [n, 3, d].
- BLOOM's fused QKV is per head [n, 3, d], as ours.
- Llama has separate q/k/v; ours is per query group [G, n/G + 2, d]. Its gate and up
  projections are stacked [gate; up] in our ``fc1``. Both use the rotate-half RoPE.

transformers itself is never imported here: the config is written as the JSON its classes read.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch

from megatron3d.config import ModelConfig
from megatron3d.convert.hf import numerics
from megatron3d.errors import ConfigError

ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "bloom": "BloomForCausalLM",
                 "llama": "LlamaForCausalLM"}
_TANH_GELU = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
_GPT2_CONV1D = {"attention.dense": "attn.c_proj", "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj"}
Tensors = Iterator[tuple[str, torch.Tensor]]


def flavour_of(m: ModelConfig) -> str:
    """Which transformers class holds this model exactly; ``ConfigError`` if none does."""
    traits = (m.position_embedding_type, m.normalization, m.swiglu, m.add_bias,
              m.embed_layernorm)
    if traits == ("learned_absolute", "layernorm", False, True, False) and m.tie_embeddings \
            and not m.group_query_attention:
        return "gpt2"
    if traits == ("alibi", "layernorm", False, True, True) and m.tie_embeddings \
            and not m.group_query_attention and m.ffn_size == 4 * m.hidden_size:
        return "bloom"
    if traits == ("rope", "rmsnorm", True, False, False):
        return "llama"
    raise ConfigError(
        f"no Hugging Face architecture matches this model (positions {traits[0]}, "
        f"{traits[1]}, swiglu {traits[2]}, biases {traits[3]}, embedding norm {traits[4]}, "
        f"tied head {m.tie_embeddings}): export supports the GPT-2, BLOOM and Llama flavours "
        "as the README's model flavours define them")


def hf_config(m: ModelConfig, eod: int | None = None) -> dict[str, Any]:
    """config.json for ``m``'s transformers class (the logical, unpadded vocabulary).
    ``eod``: the end-of-document token, which transformers' generate stops at; without one
    the ids are null (transformers' defaults, e.g. GPT-2's 50256, would be wrong here)."""
    flavour = flavour_of(m)
    common = {"architectures": [ARCHITECTURES[flavour]], "vocab_size": m.vocab_size,
              "tie_word_embeddings": m.tie_embeddings, "torch_dtype": "float32",
              "bos_token_id": eod, "eos_token_id": eod}
    if flavour == "gpt2":
        return {**common, "model_type": "gpt2", "n_layer": m.num_layers, "n_embd": m.hidden_size,
                "n_head": m.num_attention_heads, "n_inner": m.ffn_size,
                "n_positions": m.max_positions, "activation_function": "gelu_new",
                "layer_norm_epsilon": m.layernorm_epsilon, "resid_pdrop": 0.0,
                "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    if flavour == "bloom":
        return {**common, "model_type": "bloom", "n_layer": m.num_layers,
                "hidden_size": m.hidden_size, "n_head": m.num_attention_heads,
                "layer_norm_epsilon": m.layernorm_epsilon, "hidden_dropout": 0.0,
                "attention_dropout": 0.0, "apply_residual_connection_post_layernorm": False}
    return {**common, "model_type": "llama", "num_hidden_layers": m.num_layers,
            "hidden_size": m.hidden_size, "intermediate_size": m.ffn_size,
            "num_attention_heads": m.num_attention_heads,
            "num_key_value_heads": m.query_groups, "head_dim": m.head_dim,
            "max_position_embeddings": m.seq_length, "rms_norm_eps": m.layernorm_epsilon,
            "rope_theta": m.rotary_base,  # transformers < 5 reads this, >= 5 the next line
            "rope_parameters": {"rope_type": "default", "rope_theta": m.rotary_base},
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False}


def model_fields(hf: dict[str, Any], seq_length: int | None) -> dict[str, Any]:
    """ModelConfig fields of a transformers config.json; ``ConfigError`` naming the key for
    a missing or mistyped value, or an option we do not implement."""
    kind = hf.get("model_type")
    if kind == "gpt2":
        _require(hf, "activation_function", lambda v: v in _TANH_GELU, "a tanh-GeLU")
        _require(hf, "tie_word_embeddings", lambda v: v is not False, "a tied head")
        for key, want in numerics.GPT2_ATTENTION.items():
            _require(hf, key, lambda v, w=want: v is w, str(want).lower())
        h, heads = _int(hf, "n_embd"), _int(hf, "n_head")
        _divisible(hf, "n_embd", "n_head")
        return {"num_layers": _int(hf, "n_layer"), "hidden_size": h,
                "num_attention_heads": heads, "ffn_hidden_size": _int(hf, "n_inner", 4 * h),
                "max_position_embeddings": _int(hf, "n_positions"),
                "seq_length": seq_length or _int(hf, "n_positions"),
                "vocab_size": _int(hf, "vocab_size"),
                "layernorm_epsilon": _float(hf, "layer_norm_epsilon", 1e-5),
                **numerics.dropouts(hf, "resid_pdrop", "attn_pdrop", 0.1)}
    if kind == "bloom":
        _require(hf, "apply_residual_connection_post_layernorm", lambda v: not v, "false")
        _require(hf, "tie_word_embeddings", lambda v: v is not False, "a tied head")
        _divisible(hf, "hidden_size", "n_head")
        return {"num_layers": _int(hf, "n_layer"), "hidden_size": _int(hf, "hidden_size"),
                "num_attention_heads": _int(hf, "n_head"), "seq_length": seq_length or 2048,
                "vocab_size": _int(hf, "vocab_size"), "position_embedding_type": "alibi",
                "embed_layernorm": True,
                "layernorm_epsilon": _float(hf, "layer_norm_epsilon", 1e-5),
                **numerics.dropouts(hf, "hidden_dropout", "attention_dropout", 0.0)}
    if kind == "llama":
        return _llama_fields(hf, seq_length)
    raise ConfigError(f"unsupported Hugging Face model_type {kind!r}: import supports gpt2, "
                      "bloom and llama")


def _llama_fields(hf: dict[str, Any], seq_length: int | None) -> dict[str, Any]:
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise _mistyped("rope_parameters", rope, "an object such as {\"rope_type\": "
                        "\"default\", \"rope_theta\": 10000.0}")
    _require({"rope_type": rope.get("rope_type", rope.get("type", "default"))}, "rope_type",
             lambda v: v == "default", "default (no RoPE scaling)")
    for key in ("attention_bias", "mlp_bias"):
        _require(hf, key, lambda v: not v, "false")
    _require(hf, "hidden_act", lambda v: v == "silu", "silu")
    heads, h = _int(hf, "num_attention_heads"), _int(hf, "hidden_size")
    _divisible(hf, "hidden_size", "num_attention_heads")
    _require(hf, "head_dim", lambda v: v in (None, h // heads), "hidden_size / heads")
    groups = _int(hf, "num_key_value_heads", heads)
    _divisible(hf, "num_attention_heads", "num_key_value_heads")
    return {"num_layers": _int(hf, "num_hidden_layers"), "hidden_size": h,
            "num_attention_heads": heads, "group_query_attention": groups != heads,
            "num_query_groups": groups if groups != heads else None,
            "ffn_hidden_size": _int(hf, "intermediate_size"),
            "seq_length": seq_length or _int(hf, "max_position_embeddings"),
            "vocab_size": _int(hf, "vocab_size"), "position_embedding_type": "rope",
            "normalization": "rmsnorm", "swiglu": True, "disable_bias_linear": True,
            "untie_embeddings_and_output_weights": not _bool(hf, "tie_word_embeddings", False),
            "layernorm_epsilon": _float(hf, "rms_norm_eps", 1e-6),
            "rotary_base": _float(rope, "rope_theta", _float(hf, "rope_theta", 10000.0)),
            **numerics.dropouts(hf, None, "attention_dropout", 0.0)}


def _require(hf: dict[str, Any], key: str, ok: Callable[[Any], bool], want: str) -> None:
    if key in hf and not ok(hf[key]):
        raise ConfigError(f"the Hugging Face config has {key}={hf[key]!r}, which megatron3d "
                          f"does not implement (it needs {want}): this checkpoint cannot be "
                          "imported")


_REQUIRED: Any = object()


def _value(hf: dict[str, Any], key: str, default: Any, want: str) -> Any:
    """``hf[key]``; ``default`` when it is absent or null, unless it is required."""
    value = hf.get(key)
    if value is not None:
        return value
    if default is _REQUIRED:
        raise ConfigError(f"the Hugging Face config.json has no {key} ({want}): the file is "
                          "incomplete; add the key, or save the model again with "
                          "save_pretrained")
    return default


def _int(hf: dict[str, Any], key: str, default: Any = _REQUIRED) -> int:
    """A size: a whole number >= 1."""
    value = _value(hf, key, default, "a whole number >= 1")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _mistyped(key, value, "a whole number >= 1")
    return value


def _float(hf: dict[str, Any], key: str, default: float) -> float:
    """An epsilon or a base: a finite number > 0."""
    value = _value(hf, key, default, "a number > 0")
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not math.isfinite(value) or value <= 0:
        raise _mistyped(key, value, "a finite number > 0")
    return float(value)


def _bool(hf: dict[str, Any], key: str, default: bool) -> bool:
    value = _value(hf, key, default, "true or false")
    if not isinstance(value, bool):
        raise _mistyped(key, value, "true or false")
    return value


def _divisible(hf: dict[str, Any], total: str, parts: str) -> None:
    """``hf[total]`` splits evenly into ``hf[parts]`` (both checked sizes when present)."""
    value, count = _int(hf, total), _int(hf, parts, 1)
    if value % count:
        raise ConfigError(f"the Hugging Face config.json has {total}={value}, which "
                          f"{parts}={count} does not divide: the file is damaged; fix one "
                          "of the two values")


def _mistyped(key: str, value: Any, want: str) -> ConfigError:
    return ConfigError(f"the Hugging Face config.json has {key}={value!r}, expected {want}: "
                       "fix the value (the file is damaged or was edited by hand)")


# --------------------------------------------------------------------------- tensors


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
    if flavour == "llama":
        if ".attention.qkv." in name:
            q, k, v = _split_groups(tensor, m)
            base = f"{_llama_layer(layer)}.self_attn"
            yield from ((f"{base}.q_proj.weight", q), (f"{base}.k_proj.weight", k),
                        (f"{base}.v_proj.weight", v))
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
    groups, d = m.query_groups, m.head_dim
    per = m.num_attention_heads // groups
    view = t.reshape(groups, per + 2, d, -1)
    q = view[:, :per].reshape(groups * per * d, -1)
    return q.contiguous(), view[:, per].reshape(groups * d, -1).contiguous(), \
        view[:, per + 1].reshape(groups * d, -1).contiguous()


def _join_groups(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 m: ModelConfig) -> torch.Tensor:
    groups, d = m.query_groups, m.head_dim
    per = m.num_attention_heads // groups
    h = q.shape[-1]
    return torch.cat([q.reshape(groups, per, d, h), k.reshape(groups, 1, d, h),
                      v.reshape(groups, 1, d, h)], dim=1).reshape(-1, h)


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
        elif flavour == "llama" and ".attention.qkv." in name:
            base = f"{_llama_layer(layer)}.self_attn"
            yield name, _join_groups(*(get(f"{base}.{p}_proj.weight") for p in "qkv"), m)
        elif flavour == "llama" and ".mlp.fc1." in name:
            base = f"{_llama_layer(layer)}.mlp"
            yield name, torch.cat([get(f"{base}.gate_proj.weight"),
                                   get(f"{base}.up_proj.weight")])
        else:
            yield name, get(hf_name(flavour, name)).contiguous()
