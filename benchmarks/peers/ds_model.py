"""DeepSpeed's side of a row: its ZeRO engine around the plain GPT-2, or its PipelineModule
made of the same blocks, loaded with megatron3d's weights.

Both use a client ``torch.optim.AdamW`` with the others' parameter groups, so the optimizer
math is the one every row runs; DeepSpeed owns the rest (partitioning, gradient reduction
and accumulation, clipping, the pipeline schedule and the tied-weight reduction).
"""

from __future__ import annotations

from typing import Any

import deepspeed
import torch
import torch.nn.functional as F  # noqa: N812
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from torch import nn

from benchmarks.peers.config import PeerConfig, Row
from benchmarks.peers.gpt2 import GPT2, Block, lm_loss
from benchmarks.peers.names import stage_state
from benchmarks.peers.torch_optim import adamw

Weights = dict[str, torch.Tensor]


def ds_config(cfg: PeerConfig, row: Row) -> dict[str, Any]:
    """fp32, the shared batch sizes, clipping at ``clip_grad`` (DeepSpeed's default is 1.0;
    it is written out so that a change of the config reaches it), ZeRO stage of the row."""
    return {"train_batch_size": cfg.global_batch_size,
            "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
            "gradient_clipping": cfg.clip_grad,
            "zero_optimization": {"stage": int(row.option("zero", "0"))},
            "fp16": {"enabled": False}, "bf16": {"enabled": False},
            "steps_per_print": 10**9, "wall_clock_breakdown": False}


def zero_engine(cfg: PeerConfig, row: Row, weights: Weights) -> Any:
    """The whole plain GPT-2 (a tied head) under DeepSpeed's ZeRO-1 or ZeRO-3 engine."""
    model = GPT2(cfg)
    model.load_state_dict(stage_state(list(model.state_dict()), weights))
    engine, *_ = deepspeed.initialize(model=model, optimizer=adamw(cfg, list(model.parameters())),
                                      config=ds_config(cfg, row))
    return engine


class WordEmbedding(nn.Module):
    """The word embedding alone: the tied module, so the last stage's copy holds nothing
    else. ``weight`` is the name DeepSpeed ties."""

    def __init__(self, cfg: PeerConfig, weights: Weights) -> None:
        super().__init__()
        self.weight = nn.Parameter(weights["embedding.word_embeddings.weight"].clone())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.weight)


class AddPositions(nn.Module):
    def __init__(self, cfg: PeerConfig, weights: Weights) -> None:
        super().__init__()
        self.weight = nn.Parameter(weights["embedding.position_embeddings.weight"].clone())

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.weight[: hidden.shape[1]]


def _head(embedding: WordEmbedding, hidden: torch.Tensor) -> torch.Tensor:
    return F.linear(hidden, embedding.weight)  # logits [b, s, V]


def _count_each_stage_once(module: PipelineModule) -> None:
    """DeepSpeed's gradient norm adds a stage's gradients only on model-parallel rank 0 or
    for parameters marked ``model_parallel``; the pipeline stages are model-parallel ranks,
    so unmarked, every stage but the first would be left out. Mark all parameters a stage
    owns; the tied copy of the embedding on a later stage stays unmarked, so it is counted
    once, on the first stage (megatron3d's and Megatron-Core's rule)."""
    copies = set()
    if not module._grid.is_first_stage:
        copies = {id(p) for tied in module.tied_modules.values() for p in tied.parameters()}
    for p in module.parameters():
        if id(p) not in copies:
            p.model_parallel = True


def _block_weights(cfg: PeerConfig, weights: Weights, prefix: str) -> Weights:
    """The plain GPT-2's tensors under ``prefix`` (e.g. a block's), without it."""
    full = stage_state(list(GPT2(cfg).state_dict()), weights)
    return {k[len(prefix):]: v for k, v in full.items() if k.startswith(prefix)}


class LoadedBlock(Block):
    """Block ``index`` with its weights: a class, as LayerSpec builds only classes."""

    def __init__(self, cfg: PeerConfig, weights: Weights, index: int) -> None:
        super().__init__(cfg)
        self.load_state_dict(_block_weights(cfg, weights, f"blocks.{index}."))


class LoadedFinalNorm(nn.LayerNorm):
    def __init__(self, cfg: PeerConfig, weights: Weights) -> None:
        super().__init__(cfg.hidden_size, eps=cfg.layernorm_eps)
        self.load_state_dict(_block_weights(cfg, weights, "ln_f."))


def pipeline_engine(cfg: PeerConfig, row: Row, weights: Weights) -> Any:
    """PipelineModule: embedding, blocks, final norm and the tied head, cut into ``row.pp``
    stages with the same number of blocks each (as megatron3d's 1F1B row); DeepSpeed runs
    its 1F1B-style TrainSchedule and sums the tied embedding's gradients."""
    layers = [TiedLayerSpec("embedding", WordEmbedding, cfg, weights),
              LayerSpec(AddPositions, cfg, weights),
              *(LayerSpec(LoadedBlock, cfg, weights, i) for i in range(cfg.num_layers)),
              LayerSpec(LoadedFinalNorm, cfg, weights),
              TiedLayerSpec("embedding", WordEmbedding, cfg, weights, forward_fn=_head)]
    module = PipelineModule(layers=layers, num_stages=row.pp, loss_fn=lm_loss,
                            partition_method="type:LoadedBlock")
    _count_each_stage_once(module)
    engine, *_ = deepspeed.initialize(model=module,
                                      optimizer=adamw(cfg, list(module.parameters())),
                                      config=ds_config(cfg, row))
    return engine
