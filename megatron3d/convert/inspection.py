"""What a checkpoint holds, as lines for a person: the run state, the layout it was saved
with, the model flags that rebuild it, and optionally every logical tensor's shape and L2
norms (weight and Adam moments), read one tensor at a time."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from itertools import groupby
from typing import Any

import torch

from megatron3d.checkpoint import io
from megatron3d.checkpoint.reader import CheckpointReader
from megatron3d.config import ModelConfig
from megatron3d.convert.contents import check_contents, model_tensors, saved_kinds
from megatron3d.convert.standalone import saved_config
from megatron3d.convert.streaming import logical_tensors


def summary(reader: CheckpointReader) -> list[str]:
    """The run state, layout and model flags."""
    meta = reader.meta
    layout = meta["layout"]
    scaler = meta["loss_scaler"]
    return [
        f"checkpoint: {reader.directory}",
        f"iteration: {meta['iteration']}",
        f"consumed samples: {meta['consumed_samples']}",
        f"consumed tokens: {meta['consumed_tokens']}",
        f"series: {io.series_of(meta) or '(none: written before series were recorded)'}",
        f"layout: TP {layout['tp']}, PP {layout['pp']}, DP {layout['dp']}, ZeRO-"
        f"{layout['zero_stage']} ({layout['world_size']} rank files)",
        f"adam step: {meta['adam_step']:g}",
        "loss scaler: " + (", ".join(f"{k} {v}" for k, v in sorted(scaler.items()))
                           if scaler else "none (no dynamic loss scaling)"),
        "model flags: " + model_flags(meta["config"]["model"]),
    ]


def model_flags(model: dict[str, Any]) -> str:
    """The saved model configuration as the command-line flags that rebuild it, in the
    order of ``ModelConfig`` (every field is named after its flag; unset fields and false
    switches are left out)."""
    order = {f.name: i for i, f in enumerate(dataclasses.fields(ModelConfig))}
    flags = []
    for name, value in sorted(model.items(), key=lambda item: order.get(item[0], len(order))):
        flag = "--" + name.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is not None and value is not False:
            shown = " ".join(map(str, value)) if isinstance(value, list) else value
            flags.append(f"{flag} {shown}")
    return " ".join(flags)


def checked_tensors(reader: CheckpointReader) -> list[tuple[str, str]]:
    """Every (name, kind) the checkpoint holds, in layer order; a checkpoint that lacks a
    tensor of its model, or holds one of the wrong shape, is refused."""
    owned = model_tensors(saved_config(reader.meta).model)
    wanted = [(p, kind) for p in owned for kind in saved_kinds(reader, p.meta.name)]
    check_contents(reader, wanted)
    return [(p.meta.name, kind) for p, kind in wanted]


def tensor_lines(reader: CheckpointReader, wanted: list[tuple[str, str]]) -> Iterator[str]:
    """One line per logical tensor of ``wanted`` (``checked_tensors``): name, shape and
    the L2 norm of each kind, read one tensor at a time."""
    for name, group in groupby(logical_tensors(reader, wanted), key=lambda item: item[0]):
        norms = [f"{kind} {float(torch.linalg.vector_norm(t, dtype=torch.float64)):.6e}"
                 for _, kind, t in group]
        yield f"{name}  {list(reader.shape(name))}  " + "  ".join(norms)
