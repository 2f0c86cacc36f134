"""Weights shared by layers on different pipeline stages (tied input/output embeddings).

Each stage holding a tied weight owns a copy. The copies start equal (every stage draws the
same position-seeded values, ``mpu/init.py``; checked at start), get the same gradient every
step (the training step all-reduces the copies'
gradients over ``embedding`` before clipping and the optimizer), and so stay bitwise
identical. Only the first stage counts the weight in the gradient norm.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron3d.mpu import comm
from megatron3d.mpu.meta import get_meta
from megatron3d.mpu.state import AxisGroup

PIECE = 2**20  # elements compared at once: a 4 MiB fp32 temporary at most


class TiedWeights:
    """The tied parameters of this stage and the group that shares them (may be empty)."""

    def __init__(self, params: list[nn.Parameter], embedding: AxisGroup) -> None:
        shared = embedding.is_member and embedding.size > 1
        self.params = [p for p in params if shared and get_meta(p).tied_key is not None]
        self.embedding = embedding

    def check_identical(self, values: list[tuple[nn.Parameter, torch.Tensor]]) -> None:
        """Raise if the copies differ (at start, after loading a checkpoint). ``values``: this
        stage's (parameter, values held here) for its tied parameters, whole or (ZeRO-3)
        the shard, which lines up across stages because tied weights are laid out alone.
        Compared ``PIECE`` elements at a time: a vocabulary table is the largest tensor of a
        model, and a copy of it would be the start's peak."""
        for p, value in values:
            same = True
            for piece in value.detach().reshape(-1).split(PIECE):
                first = comm.broadcast(piece.clone(), self.embedding, src_index=0)
                same = torch.equal(first, piece) and same  # every piece is broadcast
            flag = torch.tensor([float(same)], device=p.device)
            if comm.all_reduce(flag, self.embedding, op=comm.MIN).item() < 1:
                raise RuntimeError(f"tied copies of {get_meta(p).name} differ across pipeline "
                                   f"stages {list(self.embedding.ranks)}; this is a bug")
