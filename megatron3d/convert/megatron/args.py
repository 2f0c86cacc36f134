"""The model configuration a Megatron-LM run stored in its checkpoint's ``common.pt``.

Megatron-LM pickles its whole ``argparse.Namespace`` there. Unpickling can run any code the
file names, so it is read with torch's weights-only unpickler, allowed two things more:
``argparse.Namespace`` and Megatron's enum members (``attention_backend`` is one), which
pickle as their class called on their value and are read back as inert text, so no Megatron
code is imported or run. Anything else is refused with the reason, and the caller can take
the model flags from the command line instead. The arguments then become ``ModelConfig``
fields; an option megatron3d does not compute is refused by name.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import pickle
from pathlib import Path
from typing import Any

import torch

from megatron3d.config import ModelConfig, Range
from megatron3d.errors import ConfigError

_ENUM_MODULES = ("megatron.core.transformer.enums", "megatron.core.enums",
                 "megatron.training.enums")
_POSITIONS = {"learned_absolute": "learned_absolute", "rope": "rope"}
_NORMS = {"LayerNorm": "layernorm", "RMSNorm": "rmsnorm"}
# Megatron-LM arguments that must keep this value, with what megatron3d computes instead.
_OFF = {"apply_layernorm_1p": "a plain norm weight (no 1 + weight)", "qk_layernorm": "no "
        "norm on queries and keys", "squared_relu": "GeLU or SwiGLU", "num_experts": "a dense "
        "MLP (no mixture of experts)", "multi_latent_attention": "multi-head attention",
        "apply_residual_connection_post_layernorm": "pre-norm residuals",
        "rotary_interleaved": "rotate-half RoPE",
        "heterogeneous_layers_config_path": "identical layers", "qk_l2_norm": "no norm on "
        "queries and keys", "window_size": "full causal attention (no sliding window)",
        "mtp_num_layers": "next-token prediction only (no multi-token prediction layers)",
        "no_rope_freq": "RoPE in every layer", "attention_output_gate": "ungated attention"}


def _inert(qualified: str) -> Any:
    def stand_in(*args: Any) -> str:
        return f"{qualified}{args!r}"
    return stand_in


def read_args(common: Path) -> argparse.Namespace:
    """``common.pt``'s ``args``; ``ConfigError`` when the file cannot be read safely or
    holds none (the message says to give the model flags instead)."""
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(common)
        enums = [(_inert(n), n) for n in names if n.rpartition(".")[0] in _ENUM_MODULES]
        with torch.serialization.safe_globals([argparse.Namespace, *enums]):
            state = torch.load(common, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ConfigError(f"{common} is missing: the checkpoint is incomplete; pass the model "
                          "flags (--num-layers, --hidden-size, ...) to import it") from None
    except (pickle.UnpicklingError, RuntimeError, OSError, ValueError, EOFError) as err:
        first = (str(err).strip() or type(err).__name__).splitlines()[0][:160]
        raise ConfigError(f"{common} cannot be read with torch's weights-only loader ({first}):"
                          " it holds something other than Megatron's arguments, which could "
                          "run code; pass the model flags (--num-layers, --hidden-size, ...) "
                          "instead") from None
    args = state.get("args") if isinstance(state, dict) else None
    if not isinstance(args, argparse.Namespace):
        raise ConfigError(f"{common} holds no Megatron-LM args: pass the model flags "
                          "(--num-layers, --hidden-size, ...) to import it")
    return args


def model_fields(args: argparse.Namespace) -> dict[str, Any]:
    """ModelConfig fields of a Megatron-LM run's arguments (the vocabulary: every stored
    embedding row, which Megatron's softmax covered); ``ConfigError`` for an option that
    megatron3d does not compute."""
    a = vars(args)
    for key, want in _OFF.items():
        if a.get(key):
            _unsupported(key, a[key], want)
    _one_of(a, "position_embedding_type", _POSITIONS)
    _one_of(a, "normalization", _NORMS)
    if a.get("rotary_seq_len_interpolation_factor") not in (None, 1):
        _unsupported("rotary_seq_len_interpolation_factor",
                     a["rotary_seq_len_interpolation_factor"], "uninterpolated RoPE positions")
    if a.get("rotary_percent", 1.0) != 1.0:
        _unsupported("rotary_percent", a["rotary_percent"], "RoPE on the whole head (1.0)")
    swiglu = bool(a.get("swiglu"))
    tanh_gelu = a.get("openai_gelu") or (a.get("bias_gelu_fusion") and a.get("add_bias_linear"))
    if not swiglu and not tanh_gelu:
        _unsupported("openai_gelu", a.get("openai_gelu"), "the tanh GeLU (--openai-gelu, or "
                     "--bias-gelu-fusion with biases, which computes it)")
    heads, hidden = _need(a, "num_attention_heads"), _need(a, "hidden_size")
    if a.get("kv_channels") not in (None, hidden // heads):
        _unsupported("kv_channels", a["kv_channels"], "hidden_size / num_attention_heads")
    groups = _optional(a, "num_query_groups") if a.get("group_query_attention") else None
    return {"num_layers": _need(a, "num_layers"), "hidden_size": hidden,
            "num_attention_heads": heads, "group_query_attention": groups is not None,
            "num_query_groups": groups, "ffn_hidden_size": _optional(a, "ffn_hidden_size"),
            "seq_length": _need(a, "seq_length"),
            "max_position_embeddings": _optional(a, "max_position_embeddings"),
            "vocab_size": _need(a, "padded_vocab_size", "vocab_size"),
            "position_embedding_type": _POSITIONS[a.get("position_embedding_type",
                                                        "learned_absolute")],
            "rotary_base": _number(a, "rotary_base", 10000.0),
            # Llama 3.x scaling: Megatron fixes the other factors at our defaults (1, 4, 8192)
            "use_rope_scaling": bool(a.get("use_rope_scaling")),
            "rope_scaling_factor": _number(a, "rope_scaling_factor", 8.0),
            "add_qkv_bias": bool(a.get("add_qkv_bias")) and not a.get("add_bias_linear", True),
            "normalization": _NORMS[a.get("normalization", "LayerNorm")],
            "layernorm_epsilon": _number(a, "norm_epsilon", 1e-5, "layernorm_epsilon"),
            "swiglu": swiglu,
            "disable_bias_linear": not a.get("add_bias_linear", True),
            "untie_embeddings_and_output_weights":
                bool(a.get("untie_embeddings_and_output_weights")),
            "init_method_std": _number(a, "init_method_std", 0.02),
            "hidden_dropout": _number(a, "hidden_dropout", 0.1),
            "attention_dropout": _number(a, "attention_dropout", 0.1)}


def _need(a: dict[str, Any], key: str, field: str | None = None) -> int:
    """The whole number ``a[key]`` inside the range of the ModelConfig ``field`` it sets
    (``key`` by default): a crafted ``num_layers: 10**9`` must not build a billion layers."""
    value, bounds = a.get(key), _bounds(field or key)
    if isinstance(value, bool) or not isinstance(value, int) or value not in bounds:
        _out_of_range(key, value, f"a whole number {_words(bounds)}")
    return value


def _optional(a: dict[str, Any], key: str) -> int | None:
    return None if a.get(key) is None else _need(a, key)


def _number(a: dict[str, Any], key: str, default: float, field: str | None = None) -> float:
    """The finite number ``a[key]`` (``default`` when absent) inside its field's range."""
    value, bounds = a.get(key, default), _bounds(field or key)
    if (isinstance(value, bool) or not isinstance(value, int | float)
            or not math.isfinite(value) or value not in bounds):
        _out_of_range(key, value, f"a finite number {_words(bounds)}")
    return float(value)


def _bounds(field: str) -> Range:
    return next(f.metadata["range"] for f in dataclasses.fields(ModelConfig) if f.name == field)


def _words(bounds: Range) -> str:
    return f"in {bounds}" if bounds.high is not None else str(bounds)


def _out_of_range(key: str, value: Any, expected: str) -> None:
    raise ConfigError(f"the checkpoint's Megatron-LM args have {key}={_shown(value)}, expected "
                      f"{expected}: the file is damaged or crafted; pass the model flags "
                      "(--num-layers, --hidden-size, ...) to import it")


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:40] + "..."


def _one_of(a: dict[str, Any], key: str, known: dict[str, str]) -> None:
    if key in a and a[key] not in known:
        _unsupported(key, a[key], " or ".join(known))


def _unsupported(key: str, value: Any, want: str) -> None:
    raise ConfigError(f"the checkpoint's Megatron-LM args have {key}={value!r}, which "
                      f"megatron3d does not implement (it computes {want}): this checkpoint "
                      "cannot be imported")
