"""Contiguous buffers behind the model's parameters and their fp32 gradients.

Every parameter becomes a view into one flat buffer of the model dtype, and its gradient
(``param.main_grad``) a view into one flat fp32 buffer with the same layout. Zeroing,
clipping, data-parallel reduction and ZeRO sharding then work on a few large tensors.

fp32 models: ``param.grad`` *is* the main_grad view, so autograd accumulates micro-batches in
place with no copy. bf16/fp16 models: a post-accumulate hook adds each low-precision gradient
into the fp32 main_grad and frees it, so accumulation across micro-batches happens in fp32.

Layout: parameters in backward order (the reverse of the model's order), cut into buckets of
about ``bucket_numel`` elements so a bucket's data-parallel reduction can start while
backward is still running. Each bucket is padded to a multiple of ``align`` (the DP size) so
ZeRO can give every rank an equal slice of it. Tied parameters (shared across pipeline
stages) get their own first bucket, so every stage holding a copy lays it out identically and
the copies' ZeRO slices line up. Segments are runs of parameters with the same weight decay
and norm counting; they never cross a bucket.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from megatron3d.mpu.meta import get_meta


@dataclass(frozen=True)
class Segment:
    """A contiguous run of parameters that share weight decay and norm counting."""

    start: int
    end: int
    no_weight_decay: bool
    counted: bool
    names: tuple[str, ...]


@dataclass(frozen=True)
class Bucket:
    """A padded range of the buffers reduced as one collective."""

    start: int
    end: int
    params: tuple[nn.Parameter, ...]

    @property
    def numel(self) -> int:
        return self.end - self.start


def _add_into_main_grad(param: torch.Tensor) -> None:
    param.main_grad.add_(param.grad)
    param.grad = None


class FlatBuffers:
    """Owns the flat parameter buffer and the flat fp32 gradient buffer of some parameters.

    ``counted(param)`` says whether this rank counts the parameter in the global grad norm
    (False for copies another rank also counts: TP replicas off TP rank 0, tied copies).
    """

    def __init__(self, params: list[nn.Parameter],
                 counted: Callable[[nn.Parameter], bool] = lambda p: True,
                 bucket_numel: int | None = None, align: int = 1) -> None:
        dtypes = {p.dtype for p in params}
        assert len(dtypes) == 1, f"one parameter dtype per model, got {dtypes}"
        self.params_dtype = dtypes.pop()
        self.buckets = _plan_buckets(params, bucket_numel, align)
        total = self.buckets[-1].end if self.buckets else 0
        device = params[0].device
        self.params = torch.zeros(total, dtype=self.params_dtype, device=device)
        self.grads = torch.zeros(total, dtype=torch.float32, device=device)
        self.segments: list[Segment] = []
        for bucket in self.buckets:
            self._attach(bucket, counted)

    def _attach(self, bucket: Bucket, counted: Callable[[nn.Parameter], bool]) -> None:
        offset, run_start, run_key, run_names = bucket.start, bucket.start, None, []
        for p in bucket.params:
            key = (counted(p), get_meta(p).no_weight_decay)
            if key != run_key and run_names:
                self.segments.append(Segment(run_start, offset, run_key[1], run_key[0],
                                             tuple(run_names)))
                run_start, run_names = offset, []
            run_key = key
            run_names.append(get_meta(p).name)
            self._bind(p, offset)
            offset += p.numel()
        if run_names:
            self.segments.append(Segment(run_start, offset, run_key[1], run_key[0],
                                         tuple(run_names)))

    def _bind(self, p: nn.Parameter, offset: int) -> None:
        view = self.params[offset:offset + p.numel()].view_as(p)
        view.copy_(p.data)
        p.data = view
        p.main_grad = self.grads[offset:offset + p.numel()].view_as(p)
        if p.dtype == torch.float32:
            p.grad = p.main_grad
        else:
            p.register_post_accumulate_grad_hook(_add_into_main_grad)

    def zero_grad(self) -> None:
        self.grads.zero_()

    def offset_of(self, param: nn.Parameter) -> int:
        """Where ``param`` starts in the flat buffers."""
        return (param.main_grad.data_ptr() - self.grads.data_ptr()) // self.grads.element_size()


def _plan_buckets(params: list[nn.Parameter], bucket_numel: int | None,
                  align: int) -> list[Bucket]:
    """Tied parameters first (alone), then the rest in backward order, cut near
    ``bucket_numel`` elements at parameter boundaries; every bucket padded to ``align``."""
    tied = [p for p in params if get_meta(p).tied_key is not None]
    rest = [p for p in reversed(params) if get_meta(p).tied_key is None]
    groups = [[p] for p in tied]
    limit = bucket_numel or sum(p.numel() for p in rest) or 1
    current: list[nn.Parameter] = []
    size = 0
    for p in rest:
        current.append(p)
        size += p.numel()
        if size >= limit:
            groups.append(current)
            current, size = [], 0
    if current:
        groups.append(current)
    buckets, start = [], 0
    for group in groups:
        size = sum(p.numel() for p in group)
        padded = -(-size // align) * align
        buckets.append(Bucket(start, start + padded, tuple(group)))
        start += padded
    return buckets
