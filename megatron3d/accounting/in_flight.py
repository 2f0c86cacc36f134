"""What a pipeline rank keeps for backward: the bytes one micro-batch leaves in each of its
model chunks, and how many micro-batches its real program holds at once.

A transformer layer costs ``layer_activation_bytes``'s exact count; the embedding keeps its
token ids and dropout mask, a norm what a layer's norm keeps, the LM head its input, and the
loss one fp32 buffer of the rank's logits (the vocab-parallel cross entropy's). The counts
of micro-batches in flight are read from the rank's real pipeline program (1F1B: up to
PP - rank; interleaved: more on early ranks; GPipe: all).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron3d.accounting.activations import FP32, layer_activation_bytes
from megatron3d.accounting.context_parallel import Split
from megatron3d.config import ModelConfig
from megatron3d.pipeline.instructions import Backward, Forward
from megatron3d.pipeline.interleaved import interleaved_1f1b
from megatron3d.pipeline.schedule import schedule_for

TOKEN_ID_BYTES = 8  # int64 ids the embedding lookup keeps


@dataclass(frozen=True)
class Activations:
    """What sizes an activation: the model, and per rank the micro-batch, TP size, sequence
    parallelism, dtype, the device type whose kernels keep it (norm statistics are fp32
    on CUDA, in the activation dtype on the CPU), and the context-parallel size and
    exchange (each rank holds s/C tokens of a sequence)."""

    model: ModelConfig
    micro_batch: int
    tp: int
    sequence_parallel: bool
    dtype: torch.dtype
    device_type: str = "cuda"
    cp: int = 1
    cp_comm_type: str = "p2p"

    @property
    def tokens(self) -> int:
        """This rank's tokens of one micro-batch: M, those inside the TP region."""
        return self.model.seq_length // self.cp * self.micro_batch

    @property
    def split(self) -> Split:
        """The attention's context-parallel split (``context_parallel.py``)."""
        return Split(self.model, self.micro_batch, self.tp, self.cp, self.cp_comm_type,
                     self.dtype.itemsize)

    @property
    def outside(self) -> int:
        """Tokens outside the TP region on this rank: N (M / TP under sequence parallelism)."""
        return self.tokens // self.tp if self.sequence_parallel else self.tokens

    def layer(self, recompute: bool = True) -> int:
        """Bytes a transformer layer keeps (``recompute=False``: as if nothing were
        recomputed, what a fully recomputed layer rebuilds in its backward)."""
        return sum(self.terms(recompute).values())

    def terms(self, recompute: bool = True) -> dict[str, int]:
        """``layer_activation_bytes`` of a block, with the model's recompute or without."""
        return _layer_terms(self, recompute)

    def chunk(self, names: Sequence[str], padded_vocab: int) -> int:
        """Bytes one micro-batch leaves saved for backward in a chunk of layers ``names``
        (type names of ``gpt_layer_specs``), the loss included when it ends the model. The
        layers outside the blocks keep what the same tensors cost inside a block: a norm what
        a block's norm keeps, the head its input as the QKV projection does, the embedding a
        dropout mask of the residual stream (and its token ids)."""
        plain = self.terms(recompute=False)
        costs = {"TransformerLayer": self.layer(),
                 "InputEmbedding": plain.get("dropout masks", 0) // 2
                 + TOKEN_ID_BYTES * self.tokens,
                 "InputNorm": plain["norms"] // 2, "FinalNorm": plain["norms"] // 2,
                 "OutputEmbedding": plain["qkv input"] + self.loss(padded_vocab)}
        return sum(costs[name] for name in names)

    def loss(self, padded_vocab: int) -> int:
        """The cross entropy's fp32 buffer of this rank's logits [s, b, v/tp] and its fp32
        per-token losses and mask."""
        return FP32 * self.tokens * (padded_vocab // self.tp + 1)

    def logits(self, padded_vocab: int) -> int:
        """This rank's logits [s, b, v/tp] in the activation dtype (or their gradient)."""
        return self.dtype.itemsize * self.tokens * (padded_vocab // self.tp)


@functools.cache
def _layer_terms(sizes: Activations, recompute: bool) -> dict[str, int]:
    """Cached: the planner asks for the same few layers thousands of times."""
    model = sizes.model
    if not recompute:
        model = dataclasses.replace(model, checkpoint_activations=False,
                                    recompute_granularity=None)
    return layer_activation_bytes(model, sizes.micro_batch, sizes.tp, sizes.sequence_parallel,
                                  sizes.dtype, sizes.device_type, sizes.cp, sizes.cp_comm_type)


@functools.cache
def in_flight_states(schedule: str, stages: int, rank: int, micro_batches: int,
                     chunks: int) -> frozenset[tuple[int, ...]]:
    """Every distinct count of micro-batches in flight per chunk (forward done, backward not
    yet) that rank ``rank``'s real program passes through. A 1F1B rank (interleaved or not)
    holds a bounded number, reached within its first 2 x PP x chunks micro-batches, after
    which the counts repeat: longer programs are walked that far (``tests/planner``)."""
    if schedule == "1f1b":
        micro_batches = min(micro_batches, 2 * stages * chunks)
    program = (interleaved_1f1b(stages, rank, micro_batches, chunks) if chunks > 1
               else schedule_for(schedule, stages, rank, micro_batches))
    counts = [0] * chunks
    seen = set()
    for step in program:
        if isinstance(step, Forward | Backward):
            counts[step.chunk] += 1 if isinstance(step, Forward) else -1
            seen.add(tuple(counts))
    return frozenset(seen)


def peak_in_flight(per_chunk: Sequence[int], states: frozenset[tuple[int, ...]]) -> int:
    """The most bytes the micro-batches in flight keep at once: ``per_chunk[c]`` bytes per
    micro-batch of chunk c, over every count ``in_flight_states`` gave."""
    return max(sum(n * b for n, b in zip(counts, per_chunk, strict=True)) for counts in states)
