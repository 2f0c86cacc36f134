"""Position information that lives inside attention: rotary embeddings and ALiBi biases.

Learned absolute positions are part of the input embedding (``embedding.py``).
"""

from __future__ import annotations

import math

import torch

from megatron3d.config import ModelConfig


def rotary_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """The rotation speed of each channel pair, [d/2] fp32: base^(-2i/d), with Llama 3.x's
    scaling under ``--use-rope-scaling``."""
    d = cfg.head_dim
    inv_freq = 1.0 / cfg.rotary_base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    return _llama3_scaled(inv_freq, cfg) if cfg.use_rope_scaling else inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Llama 3.x stretches only the slow rotations to its longer context: a pair whose
    wavelength exceeds the original context / low factor turns ``factor`` times slower, one
    under context / high factor is untouched (it already cycles many times per context),
    and the ones between are blended linearly in context / wavelength. Operation for
    operation as transformers' ``llama3`` rope type, so the frequencies are its bits."""
    context = cfg.rope_scaling_original_max_position_embeddings
    low, high = cfg.rope_scaling_low_freq_factor, cfg.rope_scaling_high_freq_factor
    factor = cfg.rope_scaling_factor
    wavelength = 2 * math.pi / inv_freq
    slow = wavelength > context / low
    fast = wavelength < context / high
    scaled = torch.where(slow, inv_freq / factor, inv_freq)
    blend = (context / wavelength - low) / (high - low)
    blended = (1 - blend) * scaled / factor + blend * scaled
    return torch.where(~slow & ~fast, blended, scaled)


def rotary_tables(cfg: ModelConfig,
                  device: torch.device | None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each [s, 1, 1, d], for the half-split ("rotate half") convention. On the
    meta device only their shape is made (the planner builds thousands of layers there)."""
    shape = (cfg.seq_length, 1, 1, cfg.head_dim)
    if device is not None and torch.device(device).type == "meta":
        return torch.empty(shape, device=device), torch.empty(shape, device=device)
    angles = torch.outer(torch.arange(cfg.seq_length, dtype=torch.float32),
                         rotary_frequencies(cfg))  # [s, d/2]
    angles = torch.cat([angles, angles], dim=-1)  # [s, d]
    return (angles.cos()[:, None, None, :].to(device),
            angles.sin()[:, None, None, :].to(device))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [s, b, n, d] by position; computed in fp32, returned in x's dtype."""
    s = x.shape[0]
    x32 = x.float()
    half = x32.shape[-1] // 2
    rotated = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)
    return (x32 * cos[:s] + rotated * sin[:s]).to(x.dtype)


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """Per-head slopes of Press et al.; heads beyond a power of two take interleaved extras."""
    def powers(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = powers(closest)
    if closest < num_heads:
        slopes += powers(2 * closest)[0::2][: num_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi_causal_bias(slopes: torch.Tensor, seq_length: int, dtype: torch.dtype,
                      device: torch.device | None) -> torch.Tensor:
    """Additive attention bias [1, n, s, s]: -slope * distance, and -inf above the diagonal.

    Computed in fp32 and cast once to ``dtype``. The leading batch dimension of 1 is what lets
    SDPA apply it inside a fused kernel instead of materialising the scores.
    """
    pos = torch.arange(seq_length, dtype=torch.float32)
    distance = pos[None, :] - pos[:, None]  # [s, s], key minus query: <= 0 where allowed
    bias = slopes.to(torch.float32)[:, None, None] * distance[None]
    bias = bias.masked_fill(distance[None] > 0, float("-inf"))
    return bias.unsqueeze(0).to(device=device, dtype=dtype)


class AlibiBias:
    """The causal ALiBi bias of one rank's heads, shared by every attention layer that holds
    this object (``LayerContext.alibi``: one per rank, not one per layer).

    One tensor per (dtype, device) at the longest length asked for; a shorter sequence gets
    its top-left block, which is exactly its own bias (the bias depends on key minus query).
    """

    def __init__(self, slopes: torch.Tensor) -> None:
        self.slopes = slopes  # [n/tp] fp32
        self._built: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, seq_length: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The bias [1, n/tp, s, s] for ``seq_length`` tokens; inside a compiled layer
        made in its graph, which a cache kept here would break (``model/compiled.py``)."""
        if torch.compiler.is_compiling():
            return alibi_causal_bias(self.slopes, seq_length, dtype, device)
        bias = self._built.get((dtype, device))
        if bias is None or bias.shape[-1] < seq_length:
            bias = alibi_causal_bias(self.slopes, seq_length, dtype, device)
            self._built[(dtype, device)] = bias
        return bias[..., :seq_length, :seq_length]
