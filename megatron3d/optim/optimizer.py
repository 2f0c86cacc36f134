"""AdamW parameter groups built from per-parameter metadata, and their start-up table.

Weight decay is decided by ``ParamMeta.no_weight_decay`` (every bias and every normalisation
weight, whatever module created it), never by class checks. The optimizer sees flat slices:
one per segment part this rank updates, each a view of the fp32 master weights whose
``.grad`` is the matching view of the local fp32 gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

import torch
from torch import nn


class ShardView(Protocol):
    """What the optimizer needs of the part of the model a rank updates (``zero/shard.py``
    implements it; optim/ stays free of data-parallel code)."""

    pieces: list  # (start, end, local) ranges of the flat layout held here
    grads: torch.Tensor  # fp32 gradients of the pieces, in local coordinates
    numel: int
    params_dtype: torch.dtype

    def segment_parts(self) -> Iterator[tuple]: ...
    def counted_grads(self) -> list[torch.Tensor]: ...
    def param_part(self, start: int, end: int, local: int) -> torch.Tensor: ...
    def zero_grad(self) -> None: ...


MasterView = Callable[[int, int, int], torch.Tensor]
"""(flat_start, flat_end, local_start) -> the fp32 master weights of that range."""


def param_groups(shard: ShardView, master: MasterView, weight_decay: float) -> list[dict]:
    """Two AdamW groups (decay, no decay) of flat master slices with their gradients."""
    groups = {False: {"params": [], "weight_decay": weight_decay, "names": set()},
              True: {"params": [], "weight_decay": 0.0, "names": set()}}
    for seg, lo, hi, local in shard.segment_parts():
        flat = nn.Parameter(master(lo, hi, local))
        flat.grad = shard.grads[local:local + hi - lo]
        groups[seg.no_weight_decay]["params"].append(flat)
        groups[seg.no_weight_decay]["names"].update(seg.names)
    return [g for g in groups.values() if g["params"]]


def format_param_groups(groups: list[dict], weight_decay: float) -> str:
    """The table printed once at start: decay setting, tensor count, names."""
    decay = sorted(n for g in groups if g["weight_decay"] for n in g["names"])
    no_decay = sorted(n for g in groups if not g["weight_decay"] for n in g["names"])
    lines = ["optimizer parameter groups:",
             f"  {'group':<22}{'tensors':>8}  names"]
    for label, names in ((f"weight_decay={weight_decay:g}", decay), ("no_weight_decay", no_decay)):
        lines.append(f"  {label:<22}{len(names):>8}  {', '.join(names)}")
    return "\n".join(lines)
