"""The GPT family as one ordered list of layer specs, and its language-model loss.

GPT-2, BLOOM and Llama-style models differ only in flags (positions, norm, MLP, biases,
tying), so there is one definition. A pipeline stage builds a slice of ``gpt_layer_specs``;
without pipelining the whole list is one stage.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from megatron3d.config import ModelConfig
from megatron3d.model.context import LayerContext
from megatron3d.model.embedding import FinalNorm, InputEmbedding, InputNorm, OutputEmbedding
from megatron3d.model.transformer import TransformerLayer
from megatron3d.mpu import comm
from megatron3d.mpu.cross_entropy import vocab_parallel_cross_entropy
from megatron3d.mpu.state import AxisGroup
from megatron3d.pipeline.partition import fixed_layout, layer_weights, partition_layers
from megatron3d.pipeline.spec import LayerSpec, Stage, build_stage


def gpt_layer_specs(ctx: LayerContext) -> list[LayerSpec]:
    """embedding, [embedding norm], blocks..., final norm, LM head."""
    specs = [LayerSpec(InputEmbedding, {"ctx": ctx})]
    if ctx.cfg.embed_layernorm:
        specs.append(LayerSpec(InputNorm, {"ctx": ctx}))
    specs += [LayerSpec(TransformerLayer, {"ctx": ctx, "layer_number": i})
              for i in range(ctx.cfg.num_layers)]
    specs += [LayerSpec(FinalNorm, {"ctx": ctx}), LayerSpec(OutputEmbedding, {"ctx": ctx})]
    return specs


def layer_param_counts(ctx: LayerContext) -> list[int]:
    """Logical parameters of each spec, counted on the meta device (nothing is drawn), so
    every rank computes the same pipeline partition without building the model."""
    meta = dataclasses.replace(ctx, tp=AxisGroup.single(), device=torch.device("meta"),
                               rng=None)
    return [sum(p.numel() for p in spec.build().parameters()) for spec in gpt_layer_specs(meta)]


@functools.cache
def layer_table(model: ModelConfig) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """(type names, parameter counts) of the model's layers as the partitioner sees them,
    counted on the meta device and cached (the planner judges thousands of layouts of one
    model). With real data the vocabulary is not known yet and counts as one token: it
    changes no layer's type and leaves every count > 0, so partitions are the same."""
    bare = dataclasses.replace(model, vocab_size=model.vocab_size or 1,
                               checkpoint_activations=False, recompute_granularity=None,
                               compile=False)
    if bare != model:  # recompute and --compile change no parameter: one table for all
        return layer_table(bare)
    ctx = LayerContext(model, AxisGroup.single(), seed=0)
    return (tuple(spec.type_name for spec in gpt_layer_specs(ctx)),
            tuple(layer_param_counts(ctx)))


def split_layers(names: list[str], counts: list[int], stages: int, method: str, chunks: int,
                 per_chunk: int | None = None) -> list[int]:
    """Boundaries of the ``stages`` x ``chunks`` (virtual) stages of the layer list: with
    ``per_chunk`` (--num-layers-per-virtual-pipeline-stage) Megatron's layout of that many
    transformer layers each, embedding first and head last, as its users expect whatever
    the method; otherwise ``partition_layers`` by ``method``."""
    if per_chunk is None:
        return partition_layers(names, counts, stages, method, chunks)
    layer_weights(names, counts, method)  # a bad method is still reported
    return fixed_layout(names, TransformerLayer.__name__, stages * chunks, per_chunk)


@functools.cache
def stage_bounds(model: ModelConfig, stages: int, method: str, chunks: int,
                 per_chunk: int | None = None) -> tuple[int, ...]:
    """``split_layers`` of the model's layers (``layer_table``), as ``build_engine`` splits
    them; cached like the table."""
    names, counts = layer_table(model)
    return tuple(split_layers(list(names), list(counts), stages, method, chunks, per_chunk))


def build_gpt(ctx: LayerContext) -> Stage:
    """The whole model as a single stage: token ids [b, s] -> logits [s, b, v/tp]."""
    specs = gpt_layer_specs(ctx)
    return build_stage(specs, 0, len(specs))


def lm_loss(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor,
            ctx: LayerContext) -> torch.Tensor:
    """Mean next-token cross entropy over unmasked tokens of one micro-batch (fp32 scalar).

    logits: [s, b, v/tp]; labels and loss_mask: [b, s] (this rank's shard of each sequence
    under context parallelism). With CP size C, a rank's term is its masked sum over the
    whole micro-batch's unmasked count, times C: gradients are averaged over dp x cp (a
    division by C that this undoes), and so is the reported loss, whose sum over the CP
    ranks is the micro-batch's mean.
    """
    losses = vocab_parallel_cross_entropy(logits, labels.t(), ctx.tp, ctx.cfg.vocab_size)
    mask = loss_mask.t().to(losses.dtype)  # [s, b]
    count = mask.sum()
    if ctx.cp.size == 1:
        return (losses * mask).sum() / count
    count = comm.all_reduce(count.detach(), ctx.cp)  # every CP rank's unmasked tokens
    return (losses * mask).sum() / count * ctx.cp.size
