"""Per-parameter metadata that the optimizer, grad norm and checkpoints read.

Layers attach it when they create a parameter, so decisions such as "no weight decay" or
"replicated across TP, count once in the norm" never depend on a module's class.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron3d.mpu.init import Init

_ATTR = "megatron3d_meta"


@dataclass(frozen=True)
class ParamMeta:
    """What the rest of the framework needs to know about one parameter.

    name: logical name, unique in the whole model and independent of the parallel layout
        (e.g. ``layers.3.attention.qkv.weight``); also seeds the parameter's initialisation.
    no_weight_decay: biases and every normalisation weight.
    tp_split_dim: dimension split across tensor-parallel ranks, or None if replicated.
    tp_stride: number of stacked sub-matrices along ``tp_split_dim`` that are split
        separately (2 for a SwiGLU gate+up weight), so each rank holds its slice of each.
    tied_key: parameters sharing a key are one logical weight (tied embeddings).
    logical_rows: for a vocabulary table padded along dim 0, the number of real rows; the
        rest are padding that depends on the layout and is never part of the logical weight.
    sequence_parallel: a TP-replicated parameter applied to sequence-sharded activations, so
        each TP rank's gradient covers only its shard and must be all-reduced over TP.
    init: how its initial value is made (``init.py``), so a parameter built on the meta
        device can be drawn where it finally lives; None for foreign modules' parameters.
    """

    name: str
    no_weight_decay: bool = False
    tp_split_dim: int | None = None
    tp_stride: int = 1
    tied_key: str | None = None
    logical_rows: int | None = None
    sequence_parallel: bool = False
    init: Init | None = None


def set_meta(param: torch.nn.Parameter, meta: ParamMeta) -> torch.nn.Parameter:
    setattr(param, _ATTR, meta)
    return param


def get_meta(param: torch.nn.Parameter) -> ParamMeta:
    meta = getattr(param, _ATTR, None)
    assert meta is not None, "every megatron3d parameter is created with ParamMeta"
    return meta


def ensure_meta(module: torch.nn.Module, prefix: str) -> None:
    """Give metadata to parameters that a foreign module (e.g. ``torch.nn.LayerNorm``)
    created without it. Such parameters are TP-replicated; a 1-D one is a bias or a
    normalisation weight, so it gets no weight decay whatever the module's class."""
    for path, param in module.named_parameters():
        if getattr(param, _ATTR, None) is None:
            set_meta(param, ParamMeta(name=f"{prefix}.{path}", no_weight_decay=param.ndim < 2))
