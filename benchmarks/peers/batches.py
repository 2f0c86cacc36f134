"""The token batches every framework trains on, written once to a file.

They are megatron3d's ``--mock-data`` samples (a pure function of seed and sample index), so
the megatron3d rows read them through their own data path and the peers from the file: one
set of batches, two ways in, checked equal by the test suite.
"""

from __future__ import annotations

from pathlib import Path

import torch

from benchmarks.peers.config import PeerConfig
from megatron3d.data.mock import MockGPTDataset


def make_batches(cfg: PeerConfig) -> torch.Tensor:
    """int64 [steps, global batch, seq + 1]: step i is samples [i*G, (i+1)*G)."""
    mock = MockGPTDataset(cfg.vocab_size, cfg.seq_length, cfg.seed)
    g = cfg.global_batch_size
    return torch.stack([mock.samples(i * g, g) for i in range(cfg.steps)])


def save_batches(cfg: PeerConfig, path: Path) -> None:
    torch.save(make_batches(cfg), path)


def load_batches(path: Path) -> torch.Tensor:
    return torch.load(path, weights_only=True)


def rank_micro_batches(step_tokens: torch.Tensor, dp_rank: int, dp_size: int,
                       micro_batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(inputs, labels) [b, s] per micro-batch of this DP rank's contiguous slice, as
    megatron3d's sampler cuts it."""
    per_rank = step_tokens.shape[0] // dp_size
    mine = step_tokens[dp_rank * per_rank:(dp_rank + 1) * per_rank]
    return [(c[:, :-1].contiguous(), c[:, 1:].contiguous())
            for c in mine.split(micro_batch_size)]
