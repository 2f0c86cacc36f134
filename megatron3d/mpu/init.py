"""How each parameter gets its initial value, kept with it (``ParamMeta.init``), so that its
storage can be made later and elsewhere than where the layer was built.

A model built on the meta device (``LayerContext.defer_init``) has shapes and no storage. The
ZeRO stage then allocates the buffers its parameters live in and draws into them only what
this rank holds: ZeRO-0/1 each parameter's TP slice, in place in the flat buffer; ZeRO-3 only
this rank's flat range of each unit (``fill_flat``). No rank ever holds an unsharded copy of
its stage. The values are bitwise those of an eagerly built layer: both come from
``fill_normal``'s position-seeded blocks, whichever part of them is drawn.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from megatron3d.mpu.random import BLOCK_NUMEL, fill_normal


@dataclass(frozen=True)
class Normal:
    """This rank's slices ``ranges`` along ``dim`` of the logical N(0, std^2) tensor
    ``shape`` named ``name`` (its seed), in order; local slabs after them are zero (the
    padding rows of a vocabulary table)."""

    std: float
    seed: int
    name: str
    shape: tuple[int, ...]
    dim: int
    ranges: tuple[tuple[int, int], ...]

    @property
    def drawn(self) -> int:
        """Local slabs along ``dim`` that hold drawn values."""
        return sum(hi - lo for lo, hi in self.ranges)

    def logical(self, start: int, end: int) -> list[tuple[int, int]]:
        """The logical ranges of local slabs [start, end) (within the drawn ones)."""
        out, pos = [], 0
        for lo, hi in self.ranges:
            a, b = max(start, pos), min(end, pos + hi - lo)
            if a < b:
                out.append((lo + a - pos, lo + b - pos))
            pos += hi - lo
        return out


@dataclass(frozen=True)
class Constant:
    value: float


Init = Normal | Constant


def fill(init: Init, out: torch.Tensor) -> torch.Tensor:
    """The whole local tensor ``out``, as the layer would have drawn it."""
    if out.is_meta:
        return out
    if isinstance(init, Constant):
        return out.fill_(init.value)
    drawn = init.drawn
    out.narrow(init.dim, drawn, out.shape[init.dim] - drawn).zero_()
    if drawn:
        fill_normal(out.narrow(init.dim, 0, drawn), init.std, init.seed, init.name, init.shape,
                    init.dim, init.ranges)
    return out


def fill_flat(init: Init, shape: Sequence[int], out: torch.Tensor, start: int,
              end: int) -> torch.Tensor:
    """Elements [start, end) of the row-major flattening of the local tensor ``shape`` into
    the 1-D ``out``. Only the rows holding them are made; for a tensor split along columns
    (``dim`` 1) those rows are drawn a column block at a time, so the transient memory is the
    rows plus one block."""
    if out.is_meta or start == end:
        return out
    if isinstance(init, Constant):
        return out.fill_(init.value)
    rows, cols = (shape[0], 1) if len(shape) == 1 else tuple(shape)
    first, last = start // cols, -(-end // cols)
    block = torch.empty((last - first, cols), dtype=torch.float32, device=out.device)
    if init.dim == 0:
        _rows(init, block, first, last)
    else:
        step = max(1, BLOCK_NUMEL // rows)
        for c in range(0, cols, step):
            part = torch.empty((rows, min(step, cols - c)), dtype=torch.float32,
                               device=out.device)
            fill_normal(part, init.std, init.seed, init.name, init.shape, 1,
                        init.logical(c, c + part.shape[1]))
            block[:, c:c + part.shape[1]] = part[first:last]
    skip = start - first * cols
    return out.copy_(block.view(-1)[skip:skip + end - start])


def _rows(init: Normal, out: torch.Tensor, first: int, last: int) -> None:
    """Local rows [first, last) of a tensor split along rows, padding rows zero."""
    drawn = max(0, min(last, init.drawn) - first)
    out[drawn:].zero_()
    if drawn:
        fill_normal(out[:drawn], init.std, init.seed, init.name, init.shape, 0,
                    init.logical(first, first + drawn))


def bind(param: nn.Parameter, storage: torch.Tensor, init: Init | None = None) -> None:
    """Make ``param`` a view of ``storage`` (flat, ``param.numel()`` elements), keeping the
    Python object, so every module and list holding it sees the new storage. A real
    parameter's values are copied there; one built on the meta device gets ``init`` drawn
    there, or nothing (ZeRO-3's slots, filled by each gather)."""
    view = storage.view(param.shape)
    if not param.is_meta:
        view.copy_(param.detach())
        param.data = view
        return
    if init is not None:
        fill(init, view)
    if view.is_meta:
        return
    # ``.data`` keeps the parameter's own version counter (a view made by ``Parameter(view)``
    # would share its buffer's): ZeRO-3 refills its slot in place for backward by design.
    real = nn.Parameter(view.new_empty(0), requires_grad=param.requires_grad)
    real.data = view
    real.__dict__.update(param.__dict__)  # ParamMeta and any other tags
    torch.utils.swap_tensors(param, real)
