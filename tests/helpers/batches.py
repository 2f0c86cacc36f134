"""Check that a dataset's global batches do not depend on the data-parallel size."""

from __future__ import annotations

import torch

from megatron3d.data.sampler import TokenDataset, micro_batches

CPU = torch.device("cpu")


def global_tokens(dataset: TokenDataset, dp: int, consumed: int = 40, gbs: int = 16,
                  micro_batch_size: int = 2) -> torch.Tensor:
    """The global batch at ``consumed`` as every DP rank's micro-batches, concatenated."""
    parts = []
    for rank in range(dp):
        parts += [mb.tokens for mb in micro_batches(dataset, consumed, gbs, micro_batch_size,
                                                    rank, dp, CPU)]
    return torch.cat(parts)


def assert_same_global_batch(dataset: TokenDataset, dp_sizes: tuple[int, ...]) -> None:
    one = global_tokens(dataset, 1)
    assert torch.equal(one, dataset.samples(40, 16)[:, :-1])
    for dp in dp_sizes:
        assert torch.equal(global_tokens(dataset, dp), one), f"DP={dp}"
