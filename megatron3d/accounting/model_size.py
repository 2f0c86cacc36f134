"""How big the model is, as a user counts it: padded vocabulary, unique parameters, and the
stage table's layer names and tied copies.

Counted from the layer specs on the meta device (nothing is allocated or drawn, no
communication), with the real tensor-parallel size so the vocabulary carries the padding the
run allocates. A parameter is counted once however many TP ranks hold slices or replicas of it
and however many stages hold a tied copy.
"""

from __future__ import annotations

import dataclasses

import torch

from megatron3d.model.context import LayerContext
from megatron3d.model.gpt import gpt_layer_specs
from megatron3d.mpu.meta import get_meta
from megatron3d.mpu.state import AxisGroup
from megatron3d.pipeline.partition import TiedCopy

_LABELS = {"InputEmbedding": "embedding", "InputNorm": "embedding norm",
           "FinalNorm": "final norm", "OutputEmbedding": "output layer"}
_BLOCK = "TransformerLayer"


@dataclasses.dataclass(frozen=True)
class ModelSize:
    """Per layer: its parameters (name -> elements, all TP slices together) and its label."""

    layers: list[dict[str, int]]
    labels: list[str]

    @property
    def counts(self) -> list[int]:
        """Every layer's parameters, a tied weight included in each layer that uses it."""
        return [sum(layer.values()) for layer in self.layers]

    @property
    def tied(self) -> list[TiedCopy]:
        """Layers holding a weight that an earlier layer owns (a tied output embedding)."""
        owner: dict[str, int] = {}
        copies = []
        for index, layer in enumerate(self.layers):
            for name, numel in layer.items():
                if name in owner:
                    copies.append(TiedCopy(index, owner[name], numel))
                else:
                    owner[name] = index
        return copies

    @property
    def unique(self) -> int:
        """Parameters of the whole model, each counted once."""
        return sum(self.counts) - sum(copy.numel for copy in self.tied)


def model_size(ctx: LayerContext) -> ModelSize:
    """The layers of ``gpt_layer_specs(ctx)`` measured on the meta device at ``ctx.tp.size``."""
    tp = ctx.tp.size
    meta = dataclasses.replace(ctx, tp=AxisGroup(None, 0, tp, tuple(range(tp))),
                               device=torch.device("meta"), rng=None)
    layers, labels, blocks = [], [], 0
    for spec in gpt_layer_specs(meta):
        params = {}
        for p in spec.build().parameters():
            info = get_meta(p)
            params[info.name] = p.numel() * (tp if info.tp_split_dim is not None else 1)
        layers.append(params)
        if spec.type_name == _BLOCK:
            blocks += 1
            labels.append(f"transformer layer {blocks}")
        else:
            labels.append(_LABELS.get(spec.type_name, spec.type_name))
    return ModelSize(layers, labels)


def format_padded_vocab(vocab_size: int, padded: int) -> str:
    """Megatron's start-up line about the vocabulary padding."""
    return (f" > padded vocab (size: {vocab_size}) with {padded - vocab_size} dummy tokens "
            f"(new size: {padded})")
