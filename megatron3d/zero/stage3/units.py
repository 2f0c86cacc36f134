"""Units: the groups of parameters ZeRO-3 gathers with one collective.

Each layer of a pipeline stage (embedding, transformer block, final norm, LM head) owns one
unit: its parameters laid out back to back in one flat buffer. A tied weight (input and
output embeddings) is a unit of its own, whichever layers use it, so every stage holding a
copy lays it out identically and the copies' shards line up for the gradient sum over the
embedding group. A layer *needs* its own unit and any tied unit it uses.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from megatron3d.mpu.meta import get_meta


@dataclass(frozen=True)
class Units:
    """groups[u]: unit u's parameters in layout order; needs[j]: units layer j uses;
    tied: indices of the tied units (used by non-adjacent layers)."""

    groups: tuple[tuple[nn.Parameter, ...], ...]
    needs: tuple[tuple[int, ...], ...]
    tied: frozenset[int]


def stage_units(layers: list[nn.Module]) -> Units:
    groups: list[tuple[nn.Parameter, ...]] = []
    needs: list[tuple[int, ...]] = []
    tied_unit: dict[str, int] = {}
    for layer in layers:
        used: list[int] = []
        own: list[nn.Parameter] = []
        for p in layer.parameters():
            key = get_meta(p).tied_key
            if key is None:
                own.append(p)
                continue
            if key not in tied_unit:
                tied_unit[key] = len(groups)
                groups.append((p,))
            used.append(tied_unit[key])
        if own:
            used.append(len(groups))
            groups.append(tuple(own))
        needs.append(tuple(used))
    return Units(tuple(groups), tuple(needs), frozenset(tied_unit.values()))
