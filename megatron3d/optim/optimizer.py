"""AdamW parameter groups built from per-parameter metadata, and their start-up table.

Weight decay is decided by ``ParamMeta.no_weight_decay`` (every bias and every normalisation
weight, whatever module created it), never by class checks. Groups are flat slices of the
fp32 master buffer, one per ``FlatBuffers`` segment.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron3d.optim.flat_buffers import FlatBuffers


def param_groups(buffers: FlatBuffers, master: torch.Tensor,
                 weight_decay: float) -> list[dict]:
    """One AdamW group per segment: a flat fp32 master slice whose ``.grad`` is the matching
    slice of the fp32 grad buffer."""
    groups = []
    for seg in buffers.segments:
        flat = nn.Parameter(master[seg.start:seg.end])
        flat.grad = buffers.grads[seg.start:seg.end]
        groups.append({"params": [flat], "weight_decay": 0.0 if seg.no_weight_decay
                       else weight_decay, "names": seg.names})
    return groups


def format_param_groups(groups: list[dict], weight_decay: float) -> str:
    """The table printed once at start: decay setting, tensor count, elements, names."""
    decay = sorted(n for g in groups if g["weight_decay"] for n in g["names"])
    no_decay = sorted(n for g in groups if not g["weight_decay"] for n in g["names"])
    lines = ["optimizer parameter groups:",
             f"  {'group':<22}{'tensors':>8}  names"]
    for label, names in ((f"weight_decay={weight_decay:g}", decay), ("no_weight_decay", no_decay)):
        lines.append(f"  {label:<22}{len(names):>8}  {', '.join(names)}")
    return "\n".join(lines)
