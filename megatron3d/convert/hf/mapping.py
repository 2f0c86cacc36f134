"""Hugging Face transformers <-> megatron3d: architectures and config.json.

One model flavour maps to one transformers class: GPT-2 (learned positions, LayerNorm, GeLU,
tied head) to ``GPT2LMHeadModel``, BLOOM (ALiBi, embedding LayerNorm) to ``BloomForCausalLM``,
Llama-style (RoPE, optionally Llama 3.x-scaled, RMSNorm, SwiGLU, no biases, grouped-query
attention) to ``LlamaForCausalLM`` (or ``MistralForCausalLM``, the same model when it has no
sliding window), and the Llama style with a bias on q, k and v only to ``Qwen2ForCausalLM``.
The tensors' names and layouts are ``tensor_map.py``'s.

transformers itself is never imported here: the config is written as the JSON its classes read.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from megatron3d.config import ModelConfig
from megatron3d.convert.hf import numerics
from megatron3d.errors import ConfigError

ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "bloom": "BloomForCausalLM",
                 "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM"}
# The transformers families that hold each flavour exactly, the first by default.
FAMILIES = {"gpt2": ("gpt2",), "bloom": ("bloom",), "llama": ("llama", "mistral"),
            "qwen2": ("qwen2",)}
_LLAMA_LIKE = "RoPE, RMSNorm, SwiGLU and"
_TRAITS = {"gpt2": "GPT-2 has learned positions, LayerNorm, GeLU and biases",
           "bloom": "BLOOM has ALiBi, an embedding LayerNorm, GeLU and biases",
           "llama": f"Llama has {_LLAMA_LIKE} no biases",
           "mistral": f"Mistral has {_LLAMA_LIKE} no biases",
           "qwen2": f"Qwen2 has a bias on q, k and v, {_LLAMA_LIKE} no other biases"}
_TANH_GELU = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


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
        return "qwen2" if m.add_qkv_bias else "llama"
    raise ConfigError(
        f"no Hugging Face architecture matches this model (positions {traits[0]}, "
        f"{traits[1]}, swiglu {traits[2]}, biases {traits[3]}, embedding norm {traits[4]}, "
        f"tied head {m.tie_embeddings}): export supports the GPT-2, BLOOM, Llama and Qwen2 "
        "flavours as the README's model flavours define them")


def family_of(m: ModelConfig, family: str | None = None) -> str:
    """The transformers family ``m`` is exported to: ``family`` (``--model-type``) when it
    holds the model exactly, by default the flavour's first."""
    holders = FAMILIES[flavour_of(m)]
    if family is None or family in holders:
        return family or holders[0]
    raise ConfigError(f"--model-type {family} cannot hold this model: {_TRAITS[family]}; this "
                      f"model exports as {' or '.join(holders)}")


def hf_config(m: ModelConfig, eod: int | None = None,
              family: str | None = None) -> dict[str, Any]:
    """config.json for ``m``'s transformers class (the logical, unpadded vocabulary) in
    ``family`` (``family_of``). ``eod``: the end-of-document token, which transformers'
    generate stops at; without one the ids are null (transformers' defaults, e.g. GPT-2's
    50256, would be wrong here)."""
    flavour = family_of(m, family)
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
    rope = {"rope_type": "default", "rope_theta": m.rotary_base}
    if m.use_rope_scaling:
        rope = {**rope, "rope_type": "llama3", "factor": m.rope_scaling_factor,
                "low_freq_factor": m.rope_scaling_low_freq_factor,
                "high_freq_factor": m.rope_scaling_high_freq_factor,
                "original_max_position_embeddings":
                    m.rope_scaling_original_max_position_embeddings}
    own = {"llama": {"attention_bias": False, "mlp_bias": False},
           "mistral": {"sliding_window": None},
           "qwen2": {"use_sliding_window": False, "sliding_window": None}}[flavour]
    return {**common, "model_type": flavour, "num_hidden_layers": m.num_layers,
            "hidden_size": m.hidden_size, "intermediate_size": m.ffn_size,
            "num_attention_heads": m.num_attention_heads,
            "num_key_value_heads": m.query_groups, "head_dim": m.head_dim,
            "max_position_embeddings": m.seq_length, "rms_norm_eps": m.layernorm_epsilon,
            # transformers < 5 reads rope_theta and rope_scaling, >= 5 rope_parameters
            "rope_theta": m.rotary_base, "rope_scaling": rope if m.use_rope_scaling else None,
            "rope_parameters": rope, "hidden_act": "silu", **own}


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
    if kind in ("llama", "mistral", "qwen2"):
        return _llama_fields(hf, kind, seq_length)
    raise ConfigError(f"unsupported Hugging Face model_type {kind!r}: import supports gpt2, "
                      "bloom, llama, mistral and qwen2")


def _llama_fields(hf: dict[str, Any], kind: str, seq_length: int | None) -> dict[str, Any]:
    """Llama, Mistral (Llama with a sliding window) and Qwen2 (Llama with a bias on q, k
    and v, and an optional sliding window)."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise _mistyped("rope_parameters", rope, "an object such as {\"rope_type\": "
                        "\"default\", \"rope_theta\": 10000.0}")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    _require({"rope_type": rope_type}, "rope_type", lambda v: v in ("default", "llama3"),
             "default or llama3 (Llama 3.x) RoPE")
    for key in ("attention_bias", "mlp_bias"):
        _require(hf, key, lambda v: not v, "false")
    _require(hf, "hidden_act", lambda v: v == "silu", "silu")
    seq_length = seq_length or _int(hf, "max_position_embeddings")
    # a window at least as long as the sequence is causal attention over all of it
    window = hf.get("sliding_window", 4096) if kind == "mistral" or hf.get(
        "use_sliding_window") else None
    if window is not None and _int(hf, "sliding_window") < seq_length:
        raise ConfigError(f"the Hugging Face config has sliding_window={window}, shorter than "
                          f"the training sequence ({seq_length} tokens): pass --seq-length "
                          f"{window} or less (megatron3d has no sliding-window attention)")
    heads, h = _int(hf, "num_attention_heads"), _int(hf, "hidden_size")
    _divisible(hf, "hidden_size", "num_attention_heads")
    _require(hf, "head_dim", lambda v: v in (None, h // heads), "hidden_size / heads")
    groups = _int(hf, "num_key_value_heads", heads)
    _divisible(hf, "num_attention_heads", "num_key_value_heads")
    return {"num_layers": _int(hf, "num_hidden_layers"), "hidden_size": h,
            "num_attention_heads": heads, "group_query_attention": groups != heads,
            "num_query_groups": groups if groups != heads else None,
            "ffn_hidden_size": _int(hf, "intermediate_size"),
            "seq_length": seq_length, "vocab_size": _int(hf, "vocab_size"),
            "position_embedding_type": "rope", "normalization": "rmsnorm", "swiglu": True,
            "disable_bias_linear": True, "add_qkv_bias": kind == "qwen2",
            "untie_embeddings_and_output_weights": not _bool(hf, "tie_word_embeddings", False),
            "layernorm_epsilon": _float(hf, "rms_norm_eps", 1e-6),
            "rotary_base": _float(rope, "rope_theta", _float(hf, "rope_theta", 10000.0)),
            **(_llama3_fields(rope) if rope_type == "llama3" else {}),
            **numerics.dropouts(hf, None, "attention_dropout", 0.0)}


def _llama3_fields(rope: dict[str, Any]) -> dict[str, Any]:
    """Llama 3.x's RoPE scaling: every parameter required, as transformers requires them."""
    low, high = (_float(rope, f"{k}_freq_factor", _REQUIRED) for k in ("low", "high"))
    if high <= low:
        raise ConfigError(f"the Hugging Face config has high_freq_factor={high}, which must "
                          f"exceed low_freq_factor={low}: the file is damaged; fix one of them")
    factor = _float(rope, "factor", _REQUIRED)
    _require(rope, "factor", lambda v: v >= 1, "a factor of at least 1")
    return {"use_rope_scaling": True, "rope_scaling_factor": factor,
            "rope_scaling_low_freq_factor": low, "rope_scaling_high_freq_factor": high,
            "rope_scaling_original_max_position_embeddings":
                _int(rope, "original_max_position_embeddings")}


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


def _float(hf: dict[str, Any], key: str, default: Any) -> float:
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
