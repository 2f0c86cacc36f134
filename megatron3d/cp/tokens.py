"""Where a rank's tokens sit: in the sequence, at which position, in which document.

One object answers it for the attention mask, the position embeddings and the loss, whether
the sequence is whole (one process), split over context-parallel ranks, or packed with
several documents (``--reset-position-ids``, ``--reset-attention-mask``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenInfo:
    """``index`` [s_local] int64: each local token's place in the full sequence (what the
    causal mask compares: a query sees keys whose index is not above its own).
    ``position_ids`` [b, s_local] int64, or None when they equal ``index``: what RoPE, learned
    positions and ALiBi read (restarting at each document under --reset-position-ids).
    ``doc_ids`` [b, s_local] int64, or None for one document per sample: under
    --reset-attention-mask a query sees only keys of its own document."""

    index: torch.Tensor
    position_ids: torch.Tensor | None = None
    doc_ids: torch.Tensor | None = None

    def positions(self, batch: int) -> torch.Tensor:
        """[b, s_local] positions, ``index`` broadcast when none are given."""
        if self.position_ids is not None:
            return self.position_ids
        return self.index.unsqueeze(0).expand(batch, -1)

    @property
    def plain_causal(self) -> bool:
        """The whole sequence in order, one document: a kernel's own causal mask serves."""
        return self.doc_ids is None and self.position_ids is None
