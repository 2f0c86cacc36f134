"""Input and output embeddings, and the norms that sit next to them in the layer list.

The class names matter: ``--pp-partition-method type:transformer|embedding`` weighs every
layer whose class name matches, so both embeddings contain "Embedding" and the norms do not.
With tied embeddings the output layer's weight carries the input word embedding's logical name
and tied key: inside one stage it is the same parameter, across stages an identical copy.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from megatron3d.cp.tokens import TokenInfo
from megatron3d.model.context import LayerContext
from megatron3d.model.norm import Norm
from megatron3d.mpu.init import Constant, Normal, fill
from megatron3d.mpu.layers import VocabParallelEmbedding, linear_with_sequence_gather
from megatron3d.mpu.mappings import copy_to_tp_region, reduce_scatter_to_sequence_region
from megatron3d.mpu.meta import ParamMeta, get_meta, set_meta

WORD_EMBEDDINGS = "embedding.word_embeddings"
TIED_KEY = "word_embeddings"


def _vocab_table(ctx: LayerContext, name: str, tied: bool) -> VocabParallelEmbedding:
    table = VocabParallelEmbedding(ctx.padded_vocab_size, ctx.cfg.hidden_size, name=name,
                                   init_std=ctx.init_std, logical_vocab_size=ctx.cfg.vocab_size,
                                   **ctx.layer_kwargs())
    if tied:
        meta = get_meta(table.weight)
        set_meta(table.weight, dataclasses.replace(meta, tied_key=TIED_KEY))
    return table


class InputEmbedding(nn.Module):
    """Token ids [b, s] -> hidden [s, b, h]: word (+ learned position) embedding, dropout."""

    def __init__(self, ctx: LayerContext) -> None:
        super().__init__()
        cfg = ctx.cfg
        self.word_embeddings = _vocab_table(ctx, WORD_EMBEDDINGS, cfg.tie_embeddings)
        self.position_embeddings = None
        if cfg.position_embedding_type == "learned_absolute":
            name = "embedding.position_embeddings.weight"
            shape = (cfg.max_positions, cfg.hidden_size)
            init = (Normal(ctx.init_std, ctx.seed, name, shape, 0, ((0, shape[0]),))
                    if ctx.draw_weights else Constant(0.0))  # TP-replicated: all of it
            table = torch.empty(shape, dtype=ctx.params_dtype, device=ctx.param_device)
            self.position_embeddings = set_meta(
                nn.Parameter(fill(init, table)),  # [p, h]
                ParamMeta(name=name, sequence_parallel=ctx.sequence_parallel, init=init))
        self.ctx = ctx

    takes_token_info = True  # learned positions are the tokens' own (Stage.forward)

    def forward(self, tokens: torch.Tensor, info: TokenInfo | None = None) -> torch.Tensor:
        """``info``: the tokens' positions when they are not 0..s-1 (a context-parallel
        shard, documents restarting their positions)."""
        if self.ctx.sequence_parallel:
            x = self._sequence_shard(tokens, info)
        else:
            x = self.word_embeddings(tokens)  # [b, s, h]
            if self.position_embeddings is not None:
                x = x + (self.position_embeddings[: tokens.shape[1]] if info is None
                         else self.position_embeddings[info.positions(tokens.shape[0])])
            x = x.transpose(0, 1).contiguous()  # [s, b, h]
        return self.ctx.hidden_dropout(x, self.training)

    def _sequence_shard(self, tokens: torch.Tensor, info: TokenInfo | None) -> torch.Tensor:
        """This rank's sequence shard [s/tp, b, h]: the partial lookups are summed with a
        reduce-scatter, then the shard's own positions are added."""
        partial = self.word_embeddings.partial(tokens).transpose(0, 1).contiguous()  # [s, b, h]
        x = reduce_scatter_to_sequence_region(partial, self.ctx.tp)  # [s/tp, b, h]
        if self.position_embeddings is not None:
            start = self.ctx.tp.rank * x.shape[0]
            if info is None:
                x = x + self.position_embeddings[start:start + x.shape[0]].unsqueeze(1)
            else:  # [s/tp, b] positions of this TP rank's part of the shard
                rows = info.positions(tokens.shape[0]).t()[start:start + x.shape[0]]
                x = x + self.position_embeddings[rows]
        return x


class InputNorm(Norm):
    """BLOOM's LayerNorm right after the word embedding (``--embed-layernorm``)."""

    def __init__(self, ctx: LayerContext) -> None:
        super().__init__(ctx, "embedding.norm")


class FinalNorm(Norm):
    """The norm before the LM head."""

    def __init__(self, ctx: LayerContext) -> None:
        super().__init__(ctx, "final_norm")


class OutputEmbedding(nn.Module):
    """Hidden [s, b, h] -> vocab-parallel logits [s, b, v/tp] (the LM head)."""

    def __init__(self, ctx: LayerContext) -> None:
        super().__init__()
        tied = ctx.cfg.tie_embeddings
        table = _vocab_table(ctx, WORD_EMBEDDINGS if tied else "output_layer", tied)
        self.weight = table.weight  # [v/tp, h]
        self.tp = ctx.tp
        self.sequence_parallel = ctx.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:  # [s/tp, b, h] -> [s, b, v/tp], keeping only the shard
            return linear_with_sequence_gather(x, self.weight, None, self.tp)
        return F.linear(copy_to_tp_region(x, self.tp), self.weight)
