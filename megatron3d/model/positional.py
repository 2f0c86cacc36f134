"""Position information that lives inside attention: rotary embeddings and ALiBi biases.

Learned absolute positions are part of the input embedding (``embedding.py``).
"""

from __future__ import annotations

import math

import torch


def rotary_tables(seq_length: int, head_dim: int, base: float,
                  device: torch.device | None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each [s, 1, 1, d], for the half-split ("rotate half") convention. On the
    meta device only their shape is made (the planner builds thousands of layers there)."""
    if device is not None and torch.device(device).type == "meta":
        return (torch.empty(seq_length, 1, 1, head_dim, device=device),
                torch.empty(seq_length, 1, 1, head_dim, device=device))
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
        """The bias [1, n/tp, s, s] for ``seq_length`` tokens."""
        bias = self._built.get((dtype, device))
        if bias is None or bias.shape[-1] < seq_length:
            bias = alibi_causal_bias(self.slopes, seq_length, dtype, device)
            self._built[(dtype, device)] = bias
        return bias[..., :seq_length, :seq_length]
