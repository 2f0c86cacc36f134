"""Cut a global batch into this data-parallel rank's micro-batches.

The global batch for a step is samples [consumed, consumed + gbs) of the dataset, whatever
the layout; DP rank r takes the r-th contiguous slice and splits it into micro-batches. The
position is a pure function of consumed samples, which is what makes resume exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from megatron3d.cp.tokens import TokenInfo
from megatron3d.data.documents import Documents


class TokenDataset(Protocol):
    def samples(self, start: int, count: int) -> torch.Tensor:
        """int64 [count, seq_length + 1]."""


@dataclass(frozen=True)
class MicroBatch:
    tokens: torch.Tensor  # [b, s] inputs
    labels: torch.Tensor  # [b, s] next tokens
    loss_mask: torch.Tensor  # [b, s] 1.0 where the token counts in the loss
    # where the tokens sit (positions, documents, a context-parallel shard); None for a
    # whole sequence in order, one document per sample
    token_info: TokenInfo | None = None

    @property
    def num_tokens(self) -> int:
        return self.tokens.numel()


class _Unread:
    """The micro-batch of a pipeline stage that neither embeds tokens nor computes the loss:
    it only counts. Reading it is a bug, so it says so instead of handing out tokens."""

    def __getattr__(self, name: str) -> None:
        raise AttributeError(f"a middle pipeline stage read its micro-batch's {name!r}: only "
                             "the first and last stages hold data; this is a bug")


UNREAD_BATCH = _Unread()


class UnreadDataset:
    """What a middle pipeline stage holds instead of a dataset: no file is opened, no sample
    read; its micro-batches only tell the schedule how many there are."""

    def samples(self, start: int, count: int) -> torch.Tensor:
        raise AssertionError("UnreadDataset never reads samples")


def micro_batches(dataset: TokenDataset, consumed: int, global_batch_size: int,
                  micro_batch_size: int, dp_rank: int, dp_size: int,
                  device: torch.device, documents: Documents | None = None) -> list[MicroBatch]:
    """This rank's micro-batches of the global batch that starts at ``consumed``.

    ``documents``: what the end-of-document token does (``--eod-mask-loss``: no loss where
    it is the input, do not learn to predict across a boundary; the reset flags: the
    micro-batch's ``token_info``)."""
    per_rank = global_batch_size // dp_size
    if isinstance(dataset, UnreadDataset):
        return [UNREAD_BATCH] * (per_rank // micro_batch_size)
    samples = dataset.samples(consumed + dp_rank * per_rank, per_rank)
    samples = samples.to(device, non_blocking=True)  # [gbs/dp, s+1]
    result = []
    for chunk in samples.split(micro_batch_size):
        tokens, labels = chunk[:, :-1], chunk[:, 1:]
        if documents is None:
            mask = torch.ones(labels.shape, dtype=torch.float32, device=device)
            info = None
        else:
            mask, info = documents.loss_mask(tokens), documents.token_info(tokens)
        result.append(MicroBatch(tokens=tokens, labels=labels, loss_mask=mask, token_info=info))
    return result
