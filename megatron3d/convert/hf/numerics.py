"""The training numerics a Hugging Face config sets beyond the architecture: dropout, and the
GPT-2 attention options megatron3d computes only one way.

An imported model continues as its config says (``pretrain_gpt.py --use-checkpoint-args``
takes these from the checkpoint); what cannot be carried exactly is said, one notice each.
"""

from __future__ import annotations

from typing import Any

from megatron3d.errors import ConfigError

# GPT-2 options with the only value megatron3d computes (transformers' default).
GPT2_ATTENTION = {"scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
                  "reorder_and_upcast_attn": False, "add_cross_attention": False}


def dropouts(hf: dict[str, Any], hidden: str | None, attention: str,
             default: float) -> dict[str, float]:
    """ModelConfig's dropout fields from ``hf``'s keys (``default``, transformers' own, when
    absent); no dropout on the residual stream for a family without a ``hidden`` key."""
    return {"hidden_dropout": 0.0 if hidden is None else probability(hf, hidden, default),
            "attention_dropout": probability(hf, attention, default)}


def differences(hf: dict[str, Any]) -> list[str]:
    """What the import trains otherwise than the config says, one line each: GPT-2's
    embedding dropout is its residual dropout here."""
    if hf.get("model_type") != "gpt2":
        return []
    embedding, hidden = (probability(hf, k, 0.1) for k in ("embd_pdrop", "resid_pdrop"))
    if embedding == hidden:
        return []
    return [f"config.json has embd_pdrop={embedding} and resid_pdrop={hidden}: megatron3d "
            f"drops out the embeddings as the residual stream, with {hidden}"]


def probability(hf: dict[str, Any], key: str, default: float) -> float:
    """A dropout: a number in [0, 1); ``default`` when absent or null."""
    value = hf.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1:
        raise ConfigError(f"the Hugging Face config.json has {key}={value!r}, expected a "
                          "number in [0, 1): fix the value (the file is damaged or was "
                          "edited by hand)")
    return float(value)
