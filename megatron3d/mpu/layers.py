"""Tensor-parallel layers: ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding.

Each rank draws only its slices of a weight, directly on ``device`` and in the parameter's
dtype, as ``fill_normal`` blocks of the logical tensor ``(name.weight, init_std, seed)``, cut
along the split dimension: the values are those of the single-process weight, so a TP=k model
starts identical to TP=1. The embedding is drawn at its logical vocabulary size and its
padding rows are zero, so padding never changes it. ``draw_weights=False`` (under --load)
draws nothing: the weights start at zero and the checkpoint fills them. Biases start at zero.
Every parameter carries ``ParamMeta`` saying how it is split, so the optimizer, grad norm and
checkpoints never inspect module classes. ``device=None`` builds on the CPU; pass
``megatron3d.device.device()`` to build in place.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - the conventional alias
from torch import nn

from megatron3d.errors import ConfigError
from megatron3d.mpu import comm
from megatron3d.mpu.init import Constant, Init, Normal, fill
from megatron3d.mpu.mappings import (
    copy_to_tp_region,
    eager_apply,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_region,
    scatter_to_tp_region,
)
from megatron3d.mpu.meta import ParamMeta, set_meta
from megatron3d.mpu.state import AxisGroup

Device = torch.device | str | None


def _divide(numerator: int, tp: AxisGroup, what: str) -> int:
    if numerator % tp.size != 0:
        raise ConfigError(f"{what} {numerator} does not divide by tensor-parallel size "
                          f"{tp.size}; choose a multiple of {tp.size} or change "
                          "--tensor-model-parallel-size")
    return numerator // tp.size


def _tp_ranges(length: int, tp: AxisGroup, what: str, stride: int = 1) -> list[tuple[int, int]]:
    """This rank's [start, end) ranges of a dimension of ``length`` split over ``tp``: its
    chunk of each of ``stride`` stacked sub-matrices, in order (the layout ``tp_shard``
    cuts from a full tensor)."""
    local = _divide(length, tp, what)
    if local % stride != 0:
        raise ConfigError(f"{what} {length} does not divide by tensor-parallel size x stride "
                          f"= {tp.size} x {stride}; choose a multiple of {tp.size * stride}")
    sub, chunk = length // stride, local // stride
    return [(k * sub + tp.rank * chunk, k * sub + (tp.rank + 1) * chunk) for k in range(stride)]


def _weight(shape: tuple[int, int], dim: int, ranges: list[tuple[int, int]], std: float,
            seed: int, name: str, draw: bool, dtype: torch.dtype, device: Device,
            local_rows: int | None = None) -> tuple[torch.Tensor, Init]:
    """This rank's slices ``ranges`` along ``dim`` of the logical weight ``shape``, drawn in
    place (nothing on the meta device), and how: zeros when ``draw`` is False, for a
    checkpoint to overwrite. ``local_rows``: the local size along ``dim`` when it exceeds
    the slices (zero padding rows after them)."""
    local = list(shape)
    local[dim] = local_rows or sum(end - start for start, end in ranges)
    init: Init = (Normal(std, seed, name, tuple(shape), dim, tuple(ranges)) if draw
                  else Constant(0.0))
    return fill(init, torch.empty(local, dtype=dtype, device=device)), init


def _zeros(size: int, dtype: torch.dtype, device: Device) -> torch.Tensor:
    return torch.zeros(size, dtype=dtype, device=device)


def _param(data: torch.Tensor, meta: ParamMeta) -> nn.Parameter:
    return set_meta(nn.Parameter(data), meta)


class _SequenceGatherLinear(torch.autograd.Function):
    """y = all_gather_seq(x) W^T + b that keeps only the [s/tp, b, in] shard ``x`` for the
    weight gradient and gathers it again in backward (Megatron's way): the full [s, b, in]
    input lives only while it is used, not until backward. The gradients are computed as
    autograd computes them for ``F.linear``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                tp: AxisGroup) -> torch.Tensor:
        ctx.tp, ctx.has_bias = tp, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(comm.all_gather(x, tp, dim=0), weight, bias)  # [s, b, out/tp]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        grad_2d = grad.flatten(0, -2)  # [s * b, out/tp]
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = comm.reduce_scatter(grad.matmul(weight), ctx.tp, dim=0)  # [s/tp, b, in]
        if ctx.needs_input_grad[1]:
            total = comm.all_gather(x, ctx.tp, dim=0)  # [s, b, in], again
            grad_weight = grad_2d.t().mm(total.flatten(0, -2))  # [out/tp, in]
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_2d.sum(0)
        return grad_x, grad_weight, grad_bias, None


def linear_with_sequence_gather(x: torch.Tensor, weight: torch.Tensor,
                                bias: torch.Tensor | None, tp: AxisGroup) -> torch.Tensor:
    """A column-parallel linear on a sequence-parallel input [s/tp, b, in] -> [s, b, out/tp]."""
    if tp.size == 1:
        return F.linear(x, weight, bias)
    return eager_apply(_SequenceGatherLinear, x, weight, bias, tp)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's output rows split across TP ranks (weight [out/tp, in]).

    The input is replicated (its gradient is all-reduced on the way back), or under
    ``sequence_parallel`` this rank's sequence shard, all-gathered on the way in and again in
    backward (only the shard is kept); the output stays split unless ``gather_output``.
    ``stride`` stacked sub-matrices are split separately and, when gathered, put back in
    logical order.
    """

    def __init__(self, in_features: int, out_features: int, *, tp: AxisGroup, name: str,
                 seed: int, init_std: float, bias: bool = True, gather_output: bool = False,
                 stride: int = 1, sequence_parallel: bool = False,
                 params_dtype: torch.dtype = torch.float32, device: Device = None,
                 draw_weights: bool = True) -> None:
        super().__init__()
        self.tp, self.gather_output, self.stride = tp, gather_output, stride
        self.sequence_parallel = sequence_parallel
        self.in_features, self.out_features = in_features, out_features
        rows = _tp_ranges(out_features, tp, f"{name}: output features", stride)
        weight, init = _weight((out_features, in_features), 0, rows, init_std, seed,
                               f"{name}.weight", draw_weights, params_dtype,
                               device)  # [out/tp, in]
        self.weight = _param(weight, ParamMeta(name=f"{name}.weight", tp_split_dim=0,
                                               tp_stride=stride, init=init))
        self.bias = None
        if bias:
            self.bias = _param(_zeros(weight.shape[0], params_dtype, device),  # [out/tp]
                               ParamMeta(name=f"{name}.bias", no_weight_decay=True,
                                         tp_split_dim=0, tp_stride=stride,
                                         init=Constant(0.0)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:  # [s/tp, b, in] -> [s, b, out/tp]
            y = linear_with_sequence_gather(x, self.weight, self.bias, self.tp)
        else:
            y = F.linear(copy_to_tp_region(x, self.tp), self.weight, self.bias)  # [..., out/tp]
        if not self.gather_output:
            return y
        y = gather_from_tp_region(y, self.tp)  # [..., out], rank-major
        if self.stride == 1 or self.tp.size == 1:
            return y
        # Rank-major [r0: s0 s1 | r1: s0 s1] -> logical [s0: r0 r1 | s1: r0 r1].
        chunk = self.out_features // (self.tp.size * self.stride)
        y = y.unflatten(-1, (self.tp.size, self.stride, chunk)).transpose(-3, -2)
        return y.flatten(-3)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, tp={self.tp.size}, "
                f"stride={self.stride}, gather_output={self.gather_output}")


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's input columns split across TP ranks (weight [out, in/tp]).

    Partial products are all-reduced; the replicated bias is added once, after the reduce.
    Without TP there is nothing to reduce, and the bias goes into the one ``addmm``.
    """

    def __init__(self, in_features: int, out_features: int, *, tp: AxisGroup, name: str,
                 seed: int, init_std: float, bias: bool = True, input_is_parallel: bool = True,
                 sequence_parallel: bool = False, params_dtype: torch.dtype = torch.float32,
                 device: Device = None, draw_weights: bool = True) -> None:
        super().__init__()
        self.tp, self.input_is_parallel = tp, input_is_parallel
        self.sequence_parallel = sequence_parallel
        self.in_features, self.out_features = in_features, out_features
        columns = _tp_ranges(in_features, tp, f"{name}: input features")
        weight, init = _weight((out_features, in_features), 1, columns, init_std, seed,
                               f"{name}.weight", draw_weights, params_dtype,
                               device)  # [out, in/tp]
        self.weight = _param(weight, ParamMeta(name=f"{name}.weight", tp_split_dim=1,
                                               init=init))
        self.bias = None
        if bias:
            self.bias = _param(_zeros(out_features, params_dtype, device),  # [out]
                               ParamMeta(name=f"{name}.bias", no_weight_decay=True,
                                         sequence_parallel=sequence_parallel,
                                         init=Constant(0.0)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.linear(x, self.weight, self.bias)  # [..., out]
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.tp)  # [..., in/tp]
        partial = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_region(partial, self.tp)  # [s/tp, b, out]
        else:
            y = reduce_from_tp_region(partial, self.tp)  # [..., out]
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, tp={self.tp.size}"


class VocabParallelEmbedding(nn.Module):
    """Token embedding with vocabulary rows split across TP ranks (weight [v_pad/tp, h]).

    Each rank looks up the ids it owns, zeroes the rest, and the partial rows are all-reduced.
    Padding rows (>= ``logical_vocab_size``) start at zero and are never looked up by valid ids.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp: AxisGroup, name: str,
                 seed: int, init_std: float, logical_vocab_size: int,
                 params_dtype: torch.dtype = torch.float32, device: Device = None,
                 draw_weights: bool = True) -> None:
        super().__init__()
        if not 0 < logical_vocab_size <= num_embeddings:
            raise ConfigError(f"{name}: logical vocab size {logical_vocab_size} must be in "
                              f"1..{num_embeddings} (the padded size); pad the vocabulary up")
        self.tp, self.logical_vocab_size = tp, logical_vocab_size
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        [(self.vocab_start, self.vocab_end)] = _tp_ranges(
            num_embeddings, tp, f"{name}: padded vocabulary size")
        # This rank's rows of the logical table [logical_vocab_size, h] come first; the padding
        # rows after them stay zero, so the padded size never changes a value.
        real = max(0, min(self.vocab_end, logical_vocab_size) - self.vocab_start)
        weight, init = _weight((logical_vocab_size, embedding_dim), 0,
                               [(self.vocab_start, self.vocab_start + real)] if real else [],
                               init_std, seed, f"{name}.weight", draw_weights, params_dtype,
                               device, self.vocab_end - self.vocab_start)  # [v_pad/tp, h]
        self.weight = _param(weight, ParamMeta(name=f"{name}.weight", tp_split_dim=0,
                                               logical_rows=logical_vocab_size, init=init))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [b, s] (global token ids) -> embeddings [b, s, h]."""
        return reduce_from_tp_region(self.partial(ids), self.tp)

    def partial(self, ids: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the lookup, zeros elsewhere: summed over TP it is the lookup
        (sequence parallelism sums it with a reduce-scatter instead of an all-reduce)."""
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)  # [b, s]
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight)  # [b, s, h], partial
        return out.masked_fill(outside.unsqueeze(-1), 0.0)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings} (logical {self.logical_vocab_size}), "
                f"{self.embedding_dim}, tp={self.tp.size}")
