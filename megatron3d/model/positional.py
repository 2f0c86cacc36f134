"""Position information that lives inside attention: rotary embeddings and ALiBi biases.

Learned absolute positions are part of the input embedding (``embedding.py``).
"""

from __future__ import annotations

import math

import torch


def rotary_tables(seq_length: int, head_dim: int, base: float,
                  device: torch.device | None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each [s, 1, 1, d], for the half-split ("rotate half") convention."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_length, dtype=torch.float32), inv_freq)  # [s, d/2]
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
    """Additive attention bias [n, s, s]: -slope * distance, and -inf above the diagonal."""
    pos = torch.arange(seq_length, dtype=torch.float32)
    distance = pos[None, :] - pos[:, None]  # [s, s], key minus query: <= 0 where allowed
    bias = slopes.to(torch.float32)[:, None, None] * distance[None]
    bias = bias.masked_fill(distance[None] > 0, float("-inf"))
    return bias.to(device=device, dtype=dtype)
