"""What context parallelism costs a rank: the bytes each exchange keeps for backward or holds
in flight, the bytes it sends, and the attention work of each rank under the causal mask.

With ``--context-parallel-size C`` every rank holds s/C tokens of each sequence (``cp/
layout.py``: the sequence cut into 2C chunks, rank r holding chunks r and 2C-1-r), so
everything a layer keeps per token shrinks by C (``activations.layer_activation_bytes``
counts it at s/C). Attention also needs the other ranks' keys and values; what that adds
depends on ``--cp-comm-type``. With b the micro-batch, s/C the local tokens, n query heads
and G key/value heads of this TP rank, d the head size, e the activation dtype's bytes, and
``kv = e b (s/C) 2 G d`` one rank's keys and values:

- p2p (ring): keeps only the local q, k, v, output and log-sum-exp (its backward runs the
  ring again); in flight, two K/V chunks forward (the one in hand, the one arriving) and
  backward those two and three fp32 chunks of their gradients (the own shard's, one
  travelling, one arriving). Sends (C-1) kv forward, and backward (C-1) kv and (C-1) fp32
  dK/dV (the other shards' gradients on their way home), overlapped with the attention of
  the chunk in hand;
- all_gather: keeps the gathered keys and values [b, s, 2G, d] (C kv) for backward, and the
  mask SDPA is given ([s/C, s], in the activation dtype; ALiBi's bias [b, n, s/C, s]
  instead); backward holds the gathered K/V gradients (C kv) before their reduce-scatter.
  Sends (C-1) kv forward (all-gather) and (C-1) kv backward (reduce-scatter), not
  overlapped;
- a2a (Ulysses): keeps the head-sharded q, k, v [b, s, (n + 2G)/C, d] in place of the local
  ones (as many bytes), the output once (sequence-sharded, shared with the projection; without
  attention dropout), the tokens' order (int64 [s]) and ALiBi's bias [b, n/C, s, s] where
  used; backward holds q, k, v, output and their gradients as much again. Moves (C-1)/C of
  the local q, k, v and output each way per pass, and the output once more in backward (its
  head-sharded form, not kept), not overlapped.

A (full or selective) recompute of the attention core runs its forward exchange once more.
The attention FLOPs of each rank count the query-key pairs the causal mask lets through.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron3d.config import ModelConfig

COMM_TYPES = ("p2p", "all_gather", "a2a")
FP32 = 4


@dataclass(frozen=True)
class Split:
    """One micro-batch's attention on one rank: the model, the micro-batch, the TP size, the
    CP size and exchange, and the activation dtype's bytes."""

    model: ModelConfig
    micro_batch: int
    tp: int
    cp: int = 1
    comm_type: str = "p2p"
    itemsize: int = 2

    @property
    def local_tokens(self) -> int:
        """s/C of each sequence."""
        return self.model.seq_length // self.cp

    @property
    def heads(self) -> int:
        return self.model.num_attention_heads // self.tp

    @property
    def groups(self) -> int:
        return self.model.query_groups // self.tp

    @property
    def kv(self) -> int:
        """One rank's keys and values, [b, s/C, 2G, d] in the activation dtype."""
        return (self.itemsize * self.micro_batch * self.local_tokens * 2 * self.groups
                * self.model.head_dim)

    @property
    def qkvo(self) -> int:
        """One rank's q, k, v and attention output, [b, s/C, 2n + 2G, d]."""
        return (self.itemsize * self.micro_batch * self.local_tokens
                * (2 * self.heads + 2 * self.groups) * self.model.head_dim)

    @property
    def scores(self) -> int:
        """Elements of this rank's query-key matrix per (sample, head): s/C x s."""
        return self.local_tokens * self.model.seq_length


def kept_bytes(split: Split) -> dict[str, int]:
    """What one layer's exchange keeps for backward beyond the local q, k, v, output and
    log-sum-exp (``activations.layer_activation_bytes`` counts those); nothing at C = 1."""
    if split.cp == 1 or split.comm_type == "p2p":
        return {}
    e, b = split.itemsize, split.micro_batch
    alibi = split.model.position_embedding_type == "alibi"
    bias = {"ALiBi bias": e * b * split.heads * split.scores} if alibi else {}
    if split.comm_type == "all_gather":
        return {"gathered keys and values": split.cp * split.kv,
                **(bias or {"attention mask": e * split.scores})}
    return {"the tokens' order": 8 * split.model.seq_length, **bias}


def forward_buffers(split: Split) -> int:
    """Bytes the exchange holds in flight during one layer's forward, beyond what it keeps."""
    return 2 * split.kv if split.cp > 1 and split.comm_type == "p2p" else 0


def backward_buffers(split: Split) -> int:
    """Bytes the exchange holds in flight during one layer's attention backward."""
    if split.cp == 1:
        return 0
    grads = split.kv * FP32 // split.itemsize  # one shard's fp32 dK/dV
    return {"p2p": 2 * split.kv + 3 * grads, "all_gather": split.cp * split.kv,
            "a2a": split.qkvo}[split.comm_type]


def exchange_bytes(split: Split) -> tuple[float, float]:
    """(forward, backward) bytes one rank sends for one layer's attention."""
    c = split.cp
    if c == 1:
        return 0.0, 0.0
    if split.comm_type == "p2p":  # backward: K/V again, and the other shards' fp32 dK/dV
        return (float((c - 1) * split.kv),
                float((c - 1) * split.kv * (1 + FP32 / split.itemsize)))
    if split.comm_type == "all_gather":
        return float((c - 1) * split.kv), float((c - 1) * split.kv)
    moved = (c - 1) / c * split.qkvo
    output = split.itemsize * split.micro_batch * split.local_tokens * split.heads \
        * split.model.head_dim  # traded back to heads in backward
    return moved, moved + (c - 1) / c * output


def causal_pairs(seq_length: int, cp: int, balanced: bool = True) -> list[int]:
    """Query-key pairs the causal mask lets through on each of ``cp`` ranks: with the
    load-balanced layout (chunks r and 2C-1-r of 2C) or, ``balanced=False``, contiguous
    shards. Queries of a block starting at token a of length c see a*c + c(c+1)/2 pairs."""
    def block(start: int, length: int) -> int:
        return start * length + length * (length + 1) // 2

    if not balanced:
        shard = seq_length // cp
        return [block(r * shard, shard) for r in range(cp)]
    c = seq_length // (2 * cp)
    return [block(r * c, c) + block((2 * cp - 1 - r) * c, c) for r in range(cp)]


def attention_flops(split: Split, balanced: bool = True) -> list[int]:
    """Forward matmul FLOPs of one layer's attention core on each CP rank: per visible pair,
    per sample and query head of this TP rank, 2d for q k^T and 2d for the values."""
    per_pair = 4 * split.model.head_dim * split.heads * split.micro_batch
    return [per_pair * p for p in causal_pairs(split.model.seq_length, split.cp, balanced)]


def imbalance(work: list[int]) -> float:
    """max / min over ranks: 1.0 is perfectly balanced."""
    return max(work) / min(work)
