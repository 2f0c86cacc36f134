"""What the end-of-document token means in a sample packed with several documents.

A sample is a window of the token stream, documents separated by EOD. Megatron's three
independent flags decide what the boundaries do (``get_ltor_masks_and_position_ids``):
``--reset-position-ids`` restarts positions at 0 after each EOD, ``--reset-attention-mask``
lets a token attend only to its own document (the EOD belongs to the document it ends),
``--eod-mask-loss`` drops the loss where the input token is the EOD. All of it is computed on
the device from the tokens, without a host sync: a micro-batch is built on the hot path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron3d.config import DataConfig
from megatron3d.cp.tokens import TokenInfo
from megatron3d.errors import ConfigError

FLAGS = ("eod_mask_loss", "reset_position_ids", "reset_attention_mask")


@dataclass(frozen=True)
class Documents:
    """The EOD token of the run's tokenizer and which of the flags are on."""

    eod: int
    mask_loss: bool = False
    reset_position_ids: bool = False
    reset_attention_mask: bool = False

    @classmethod
    def of(cls, data: DataConfig, eod: int | None) -> Documents | None:
        """The run's rule, or None when no flag is on (mock data has no EOD: validation
        refused the flags there)."""
        if eod is None or not any(getattr(data, name) for name in FLAGS):
            return None
        return cls(eod, data.eod_mask_loss, data.reset_position_ids, data.reset_attention_mask)

    def loss_mask(self, tokens: torch.Tensor) -> torch.Tensor:
        """float32 [b, s]: 1 where the token counts in the loss."""
        if self.mask_loss:
            return (tokens != self.eod).to(torch.float32)
        return torch.ones(tokens.shape, dtype=torch.float32, device=tokens.device)

    def token_info(self, tokens: torch.Tensor) -> TokenInfo | None:
        """Where each token of ``tokens`` [b, s] sits, with only the fields the flags ask
        for; None without a reset flag. A token's document is the count of EODs before it;
        its position, its distance from the token after the last EOD before it."""
        if not (self.reset_position_ids or self.reset_attention_mask):
            return None
        s = tokens.shape[1]
        index = torch.arange(s, device=tokens.device)
        ends = tokens == self.eod  # [b, s]
        position_ids = doc_ids = None
        if self.reset_attention_mask:
            doc_ids = ends.long().cumsum(dim=1) - ends.long()  # EODs strictly before
        if self.reset_position_ids:
            after_end = torch.where(ends, index + 1, 0)  # where the next document starts
            starts = after_end.cummax(dim=1).values  # at i: the start of token i + 1's document
            starts = torch.cat([starts.new_zeros(tokens.shape[0], 1), starts[:, :-1]], dim=1)
            position_ids = index - starts
        return TokenInfo(index=index, position_ids=position_ids, doc_ids=doc_ids)


def every_stage_reads_tokens(data: DataConfig) -> bool:
    """Whether the model's layers read where the documents lie: then every pipeline stage,
    not only the first and the last, needs the tokens to find them."""
    return data.reset_position_ids or data.reset_attention_mask


def check_document_flags(data: DataConfig) -> None:
    """The flags read the tokenizer's EOD token: mock data has none, so they would do
    nothing there (``validation.validate`` asks here)."""
    if not data.mock_data:
        return
    for name in FLAGS:
        if getattr(data, name):
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"--mock-data has no tokenizer and no end-of-document token, so "
                              f"{flag} does not apply ({flag}=True): drop {flag} or use "
                              "--data-path")
