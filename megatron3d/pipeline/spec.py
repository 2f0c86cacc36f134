"""Layer specs: a model described as an ordered list of layers that any stage can build alone.

A spec holds a layer's class and arguments, not the layer, so a pipeline stage builds only the
slice of the list it owns. Weights that several layers share (tied input and output
embeddings) are matched by ``ParamMeta.tied_key``: inside one stage the later layer reuses the
first layer's parameter; across stages each stage owns a copy, identical at start because
initialisation depends only on the seed and the logical name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from megatron3d.mpu.meta import ensure_meta, get_meta


@dataclass(frozen=True)
class LayerSpec:
    """One layer: ``build()`` returns ``cls(**kwargs)``; ``forward(x) -> x`` is its contract."""

    cls: Callable[..., nn.Module]
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def type_name(self) -> str:
        """The name partitioning by ``type:REGEX`` matches against."""
        return self.cls.__name__

    def build(self) -> nn.Module:
        return self.cls(**self.kwargs)


class Stage(nn.Module):
    """The layers one pipeline stage owns, run in order."""

    def __init__(self, layers: list[nn.Module], first_index: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.first_index = first_index  # index of layers[0] in the full spec list

    def forward(self, x: torch.Tensor, info: object | None = None) -> torch.Tensor:
        """``info``: what the micro-batch says about its tokens (``cp.tokens.TokenInfo``),
        handed to the layers that read it (``takes_token_info``); the pipeline only passes it."""
        for layer in self.layers:
            x = layer(x, info) if getattr(layer, "takes_token_info", False) else layer(x)
        return x


class VirtualStages(nn.Module):
    """The model chunks one rank holds under interleaving: chunk ``c`` is virtual stage
    ``c * p + rank``. ``layers`` lists every chunk's layers in chunk order (ZeRO binds and
    plans them as one stage's)."""

    def __init__(self, chunks: list[Stage]) -> None:
        super().__init__()
        self.chunks = nn.ModuleList(chunks)

    @property
    def layers(self) -> list[nn.Module]:
        return [layer for chunk in self.chunks for layer in chunk.layers]


def build_stage(specs: list[LayerSpec], start: int, end: int) -> Stage:
    """Build ``specs[start:end]``, sharing tied parameters between layers of this stage."""
    return build_chunks(specs, [(start, end)])[0]


def build_chunks(specs: list[LayerSpec], spans: list[tuple[int, int]]) -> list[Stage]:
    """Build the chunks ``specs[start:end]`` of one rank, sharing tied parameters between
    all of their layers."""
    chunks = []
    for start, end in spans:
        layers = [spec.build() for spec in specs[start:end]]
        for index, layer in enumerate(layers, start):
            ensure_meta(layer, f"{specs[index].type_name.lower()}{index}")
        chunks.append(Stage(layers, start))
    _tie_within([layer for chunk in chunks for layer in chunk.layers])
    return chunks


def _tie_within(layers: list[nn.Module]) -> None:
    """Make every later parameter with an already-seen tied key point at the first one."""
    owners: dict[str, nn.Parameter] = {}
    for layer in layers:
        for module in layer.modules():
            for attr, param in list(module.named_parameters(recurse=False)):
                key = get_meta(param).tied_key
                if key is None:
                    continue
                if key in owners:
                    setattr(module, attr, owners[key])
                else:
                    owners[key] = param
