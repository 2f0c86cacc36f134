"""Autograd functions at the boundaries of tensor-parallel regions.

Each forward collective has its conjugate in backward, which is what makes a TP layer's
gradients equal the single-process ones:

    copy_to_tp_region      fwd identity          bwd all-reduce
    reduce_from_tp_region  fwd all-reduce        bwd identity
    scatter_to_tp_region   fwd split last dim    bwd all-gather last dim
    gather_from_tp_region  fwd all-gather last   bwd split last dim

Sequence parallelism shards activations along the sequence (dim 0 of [s, b, h]) between TP
regions, replacing each all-reduce by a reduce-scatter plus an all-gather:

    scatter_to_sequence_region         fwd split seq       bwd all-gather seq
    reduce_scatter_to_sequence_region  fwd reduce-scatter  bwd all-gather seq

(The all-gather in front of a column-parallel linear is part of the linear,
``layers.linear_with_sequence_gather``, so that only the shard is kept for backward.)

On a size-1 axis every function is the identity and adds no autograd node. Otherwise each
runs eagerly inside code compiled by ``--compile`` (``eager_apply``): the collectives go
through ``comm.py`` as always, and the compiled regions lie between them.
``reduce_from_tp_region`` sums its input in place (no copy of the activation): the input must
be a fresh partial result that nothing else uses, and autograd's version counter stops a
backward that would need it. Incoming gradients may be shared with other graph branches, so
they are reduced on a clone.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron3d.mpu import comm
from megatron3d.mpu.state import AxisGroup


@torch.compiler.disable
def eager_apply(fn: type[torch.autograd.Function], *args: Any) -> Any:
    """``fn.apply(*args)``, never traced: a boundary between compiled regions."""
    return fn.apply(*args)


def _split_last(x: torch.Tensor, tp: AxisGroup) -> torch.Tensor:
    """This rank's contiguous chunk of the last dimension."""
    if x.shape[-1] % tp.size != 0:
        raise ValueError(f"last dim {x.shape[-1]} does not divide by tp size {tp.size}")
    return x.chunk(tp.size, dim=-1)[tp.rank].contiguous()  # [..., d/tp]


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: AxisGroup) -> torch.Tensor:
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return comm.all_reduce(grad.clone(), ctx.tp), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: AxisGroup) -> torch.Tensor:
        ctx.mark_dirty(x)
        return comm.all_reduce(x, tp)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: AxisGroup) -> torch.Tensor:
        ctx.tp = tp
        return _split_last(x, tp)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return comm.all_gather(grad.contiguous(), ctx.tp, dim=-1), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: AxisGroup) -> torch.Tensor:
        ctx.tp = tp
        return comm.all_gather(x.contiguous(), tp, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _split_last(grad, ctx.tp), None


def copy_to_tp_region(x: torch.Tensor, tp: AxisGroup) -> torch.Tensor:
    """Enter a TP region with a replicated input: identity forward, all-reduce backward."""
    return x if tp.size == 1 else eager_apply(_CopyToTP, x, tp)


def reduce_from_tp_region(x: torch.Tensor, tp: AxisGroup) -> torch.Tensor:
    """Leave a TP region by summing partial results: all-reduce forward (in place: ``x`` is
    consumed), identity backward."""
    return x if tp.size == 1 else eager_apply(_ReduceFromTP, x, tp)


def scatter_to_tp_region(x: torch.Tensor, tp: AxisGroup) -> torch.Tensor:
    """Keep this rank's chunk of the last dim: split forward, all-gather backward."""
    return x if tp.size == 1 else eager_apply(_ScatterToTP, x, tp)


def gather_from_tp_region(x: torch.Tensor, tp: AxisGroup) -> torch.Tensor:
    """Concatenate every rank's last-dim chunk: all-gather forward, split backward."""
    return x if tp.size == 1 else eager_apply(_GatherFromTP, x, tp)


class _ScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: AxisGroup) -> torch.Tensor:
        ctx.tp = tp
        if x.shape[0] % tp.size != 0:
            raise ValueError(f"sequence length {x.shape[0]} does not divide by tp {tp.size}")
        return x.chunk(tp.size, dim=0)[tp.rank].contiguous()  # [s/tp, b, h]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return comm.all_gather(grad.contiguous(), ctx.tp, dim=0), None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: AxisGroup) -> torch.Tensor:
        ctx.tp = tp
        return comm.reduce_scatter(x.contiguous(), tp, dim=0)  # [s/tp, b, h]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return comm.all_gather(grad.contiguous(), ctx.tp, dim=0), None


def scatter_to_sequence_region(x: torch.Tensor, tp: AxisGroup) -> torch.Tensor:
    return x if tp.size == 1 else eager_apply(_ScatterToSequence, x, tp)


def reduce_scatter_to_sequence_region(x: torch.Tensor, tp: AxisGroup) -> torch.Tensor:
    return x if tp.size == 1 else eager_apply(_ReduceScatterToSequence, x, tp)
