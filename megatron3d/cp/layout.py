"""Which tokens of a sequence each context-parallel rank holds: pure index math.

Causal attention makes late tokens cost more than early ones (a query attends to every key
before it), so contiguous shards would leave the last rank with most of the work. The
sequence is cut into 2C chunks and rank r holds chunks r and 2C-1-r: an early and a late one,
the same work on every rank (Megatron's load balancing).
"""

from __future__ import annotations

import functools

import torch

from megatron3d.errors import ConfigError


def chunk_size(seq_length: int, cp_size: int) -> int:
    """Tokens per chunk; the sequence must cut into 2C equal chunks."""
    if seq_length % (2 * cp_size) != 0:
        raise ConfigError(f"--seq-length {seq_length} does not divide into 2 x "
                          f"--context-parallel-size = {2 * cp_size} equal chunks; use a "
                          f"multiple of {2 * cp_size}")
    return seq_length // (2 * cp_size)


@functools.lru_cache(maxsize=64)
def rank_index(seq_length: int, cp_size: int, cp_rank: int,
               device: torch.device | None = None) -> torch.Tensor:
    """[seq_length / C] int64: the sequence places rank ``cp_rank`` holds, in its order
    (chunk r, then chunk 2C-1-r). All of them in order when C = 1. Made once per shape and
    device (every micro-batch, and every attention layer of a stage that reads no data,
    asks for it): read it, never write to it."""
    if cp_size == 1:
        return torch.arange(seq_length, device=device)
    c = chunk_size(seq_length, cp_size)
    late = 2 * cp_size - 1 - cp_rank
    return torch.cat([torch.arange(cp_rank * c, (cp_rank + 1) * c, device=device),
                      torch.arange(late * c, (late + 1) * c, device=device)])


def shard(x: torch.Tensor, dim: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """This rank's tokens of ``x`` along its sequence dimension ``dim`` (a new tensor)."""
    if cp_size == 1:
        return x
    index = rank_index(x.shape[dim], cp_size, cp_rank, x.device)
    return x.index_select(dim, index)
