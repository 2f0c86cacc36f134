"""A micro-batch as one context-parallel rank sees it: its two chunks of every sequence.

The CP ranks of one data-parallel coordinate read the same micro-batches (the sampler and
batch schedule know only the data-parallel axis); each keeps its shard of every [b, s]
tensor and a ``TokenInfo`` saying where those tokens sit in the whole sequence, so the
causal mask, the positions and the loss stay those of the whole sequence.
"""

from __future__ import annotations

import dataclasses
from typing import TypeVar

import torch

from megatron3d.cp.layout import rank_index
from megatron3d.cp.tokens import TokenInfo
from megatron3d.mpu.state import AxisGroup

B = TypeVar("B")
_PER_TOKEN = ("tokens", "labels", "loss_mask")  # the [b, s] tensors of a micro-batch


def shard_micro_batch(batch: B, cp: AxisGroup) -> B:
    """``batch`` (a dataclass with ``tokens``, ``labels``, ``loss_mask`` [b, s] and
    ``token_info``) cut to ``cp``'s rank: a new batch. Unchanged without CP, and where a
    middle pipeline stage holds no data (not a dataclass)."""
    if cp.size == 1 or not dataclasses.is_dataclass(batch):
        return batch
    tokens = batch.tokens
    seq = tokens.shape[1]
    index = rank_index(seq, cp.size, cp.rank, tokens.device)
    whole = batch.token_info
    info = (TokenInfo(index=index) if whole is None else
            TokenInfo(index=whole.index.index_select(0, index),
                      position_ids=_take(whole.position_ids, index),
                      doc_ids=_take(whole.doc_ids, index)))
    cut = {name: getattr(batch, name).index_select(1, index) for name in _PER_TOKEN}
    return dataclasses.replace(batch, **cut, token_info=info)


def _take(x: torch.Tensor | None, index: torch.Tensor) -> torch.Tensor | None:
    return None if x is None else x.index_select(1, index)
