"""The flag combinations context parallelism cannot run, each refused in one line before
any process starts (``validation.validate`` asks here; the world size is ``Topology``'s).

Written against the two config sections it reads, not their classes: ``cp/`` sits below
``config/``'s importers on the floor plan, and needs only these attributes.
"""

from __future__ import annotations

import math
from typing import Protocol

from megatron3d.cp.layout import chunk_size
from megatron3d.errors import ConfigError


class ParallelFlags(Protocol):
    context_parallel_size: int
    cp_comm_type: str
    tensor_model_parallel_size: int
    sequence_parallel: bool


class ModelFlags(Protocol):
    seq_length: int
    num_attention_heads: int
    group_query_attention: bool
    num_query_groups: int | None
    attention_dropout: float


def check_context_parallel(parallel: ParallelFlags, model: ModelFlags) -> None:
    """Raise ``ConfigError`` for the first combination of ``parallel`` and ``model`` that
    context parallelism of size > 1 cannot run."""
    cp, tp = parallel.context_parallel_size, parallel.tensor_model_parallel_size
    if cp == 1:
        return
    chunk_size(model.seq_length, cp)  # the sequence cuts into 2C chunks
    if parallel.sequence_parallel and (model.seq_length // cp) % tp:
        step = math.lcm(2 * cp, cp * tp)
        raise ConfigError(
            f"--seq-length {model.seq_length}: under --sequence-parallel each rank's "
            f"{model.seq_length // cp} tokens (--context-parallel-size {cp}) split again over "
            f"--tensor-model-parallel-size {tp}; use a multiple of {step}")
    if parallel.cp_comm_type == "a2a":
        _check_heads_split(model, tp, cp)
    if parallel.cp_comm_type == "p2p" and model.attention_dropout > 0:
        raise ConfigError(
            f"--attention-dropout {model.attention_dropout} is not supported by the ring "
            "exchange (--cp-comm-type p2p); pass --attention-dropout 0 or --cp-comm-type "
            "all_gather or a2a")


def _check_heads_split(model: ModelFlags, tp: int, cp: int) -> None:
    """Ulysses trades the sequence split for a head split: every TP rank's heads, and its
    key/value groups under grouped-query attention, must divide among the CP ranks."""
    sizes = [("--num-attention-heads", model.num_attention_heads)]
    if model.group_query_attention and model.num_query_groups is not None:
        sizes.append(("--num-query-groups", model.num_query_groups))
    for name, count in sizes:
        if (count // tp) % cp:
            raise ConfigError(
                f"--cp-comm-type a2a splits heads over --context-parallel-size {cp}, but "
                f"{name} {count} gives {count // tp} per tensor-parallel rank (TP {tp}); use "
                f"a {name} that is a multiple of {tp * cp}, or --cp-comm-type p2p or all_gather")
