"""What a checkpoint of a model must hold, and which pipeline stage of a layout holds each
part, derived from the model itself (built on the meta device, so nothing is drawn) and the
partitioner training uses. The offline tools check a checkpoint against it before they
write anything, so a damaged checkpoint (a lost tensor, a wrong shape) is refused up front
instead of half-converted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron3d.checkpoint.chunks import KINDS
from megatron3d.checkpoint.reader import CheckpointReader
from megatron3d.config import ZERO_STAGES, ModelConfig
from megatron3d.errors import CheckpointError, ConfigError
from megatron3d.model.context import LayerContext
from megatron3d.model.gpt import gpt_layer_specs, layer_param_counts
from megatron3d.mpu.meta import ParamMeta, get_meta
from megatron3d.mpu.state import AxisGroup
from megatron3d.pipeline.partition import partition_layers
from megatron3d.pipeline.spec import build_stage


@dataclass(frozen=True)
class Layout:
    """A parallel layout: the size of each axis and the ZeRO stage."""

    tp: int
    pp: int
    dp: int
    zero_stage: int

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def as_meta(self) -> dict[str, int]:
        """As ``meta.json`` and rank files record it (``saving.layout``)."""
        return {"world_size": self.world_size, "tp": self.tp, "pp": self.pp, "dp": self.dp,
                "zero_stage": self.zero_stage}


SINGLE = Layout(1, 1, 1, 0)


@dataclass(frozen=True)
class Owned:
    """A logical tensor of the model (each tied weight once)."""

    meta: ParamMeta
    shape: tuple[int, ...]  # logical: vocabulary padding dropped


def stage_params(model: ModelConfig, layout: Layout, method: str) -> list[list[Owned]]:
    """Per pipeline stage of ``layout`` (cut by ``method``), the logical tensors its ranks
    write in training: each one once, a tied copy on the first stage. ConfigError, naming
    the flag, for a layout training would refuse."""
    _check_layout(model, layout)
    ctx = LayerContext(model, AxisGroup.single(), 0, device=torch.device("meta"))
    specs = gpt_layer_specs(ctx)
    bounds = partition_layers([s.type_name for s in specs], layer_param_counts(ctx), layout.pp,
                              method)
    stages = []
    for stage in range(layout.pp):
        params = build_stage(specs, bounds[stage], bounds[stage + 1]).parameters()
        stages.append([Owned(get_meta(p), _logical_shape(p)) for p in params
                       if stage == 0 or get_meta(p).tied_key is None])
    return stages


def model_tensors(model: ModelConfig) -> list[Owned]:
    """Every logical tensor of ``model``, in layer order."""
    return stage_params(model, SINGLE, "uniform")[0]


def saved_kinds(reader: CheckpointReader, name: str) -> tuple[str, ...]:
    """The kinds a checkpoint holds of ``name``: Adam's moments are zero before its first
    step, so a checkpoint with Adam step 0 (a converted one) need not hold them."""
    return KINDS if reader.meta["adam_step"] else tuple(k for k in KINDS if reader.has(name, k))


def check_contents(reader: CheckpointReader, wanted: list[tuple[Owned, str]]) -> None:
    """The checkpoint holds exactly the tensors named in ``wanted`` (pairs of a tensor and
    a kind), each whole and with its logical shape: what its own configuration describes.
    Only chunk descriptions are read, so a tool checks this before it writes anything."""
    expected = {p.meta.name for p, _ in wanted}
    saved = set(reader.names())
    odd = sorted(expected ^ saved) or [f"{p.meta.name} ({kind})" for p, kind in wanted
                                       if reader.shape(p.meta.name, kind) != p.shape]
    if odd:
        raise CheckpointError(f"{reader.directory} does not hold the model its meta.json "
                              f"describes ({len(odd)} tensors differ, e.g. {odd[0]}): the "
                              "checkpoint is damaged; nothing was written")
    gaps = [f"{p.meta.name} ({kind})" for p, kind in wanted
            if not reader.complete(p.meta.name, kind)]
    if gaps:
        raise CheckpointError(f"{reader.directory} is incomplete ({len(gaps)} tensors lack "
                              f"chunks, e.g. {gaps[0]}): a rank file lost its chunks; load an "
                              "earlier checkpoint; nothing was written")


def _check_layout(model: ModelConfig, layout: Layout) -> None:
    """The rules training applies to its layout (the partitioner checks the stages)."""
    if min(layout.tp, layout.pp, layout.dp) < 1:
        raise ConfigError(f"parallel sizes must be >= 1 (TP {layout.tp}, PP {layout.pp}, DP "
                          f"{layout.dp}): give positive sizes; nothing was written")
    for what, size in (("attention heads", model.num_attention_heads),
                       ("key/value groups", model.query_groups), ("MLP size", model.ffn_size)):
        if size % layout.tp:
            raise ConfigError(f"the model's {what} ({size}) are not divisible by "
                              f"--tensor-model-parallel-size {layout.tp}: choose a size that "
                              f"divides {size}; nothing was written")
    if layout.zero_stage not in ZERO_STAGES:
        raise ConfigError(f"unknown ZeRO stage (--zero-stage {layout.zero_stage}): use 0, 1 "
                          "or 3; nothing was written")


def _logical_shape(param: torch.nn.Parameter) -> tuple[int, ...]:
    rows = get_meta(param).logical_rows
    return tuple(param.shape) if rows is None else (rows, *param.shape[1:])
