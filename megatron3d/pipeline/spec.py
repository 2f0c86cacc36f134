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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def build_stage(specs: list[LayerSpec], start: int, end: int) -> Stage:
    """Build ``specs[start:end]``, sharing tied parameters between layers of this stage."""
    layers = [spec.build() for spec in specs[start:end]]
    for index, layer in enumerate(layers, start):
        ensure_meta(layer, f"{specs[index].type_name.lower()}{index}")
    _tie_within(layers)
    return Stage(layers, start)


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
