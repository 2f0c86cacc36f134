"""Contiguous buffers behind the model's parameters and their fp32 gradients (ZeRO-0 and 1).

Every parameter becomes a view into one flat buffer of the model dtype (a parameter built on
the meta device is drawn there, in place: no second copy of the stage ever exists), and its
gradient (``param.main_grad``) a view into one flat fp32 buffer, both laid out by a
``FlatLayout``.
Zeroing, clipping, data-parallel reduction and ZeRO-1 sharding then work on a few large
tensors.

One gradient hook per parameter does everything that must follow a gradient's arrival, in
order: a bf16/fp16 gradient is added into the fp32 main_grad and freed (so micro-batches
accumulate in fp32), then the parameter's bucket is counted down (``on_ready``), which lets the
reducer start that bucket's collective while backward continues. fp32 models need no copy:
``param.grad`` *is* the main_grad view, so autograd accumulates in place.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from megatron3d.mpu.init import bind
from megatron3d.mpu.meta import get_meta
from megatron3d.zero.layout import FlatLayout


class FlatBuffers:
    """Owns the flat parameter buffer and the flat fp32 gradient buffer of a layout."""

    def __init__(self, layout: FlatLayout, params_dtype: torch.dtype,
                 device: torch.device) -> None:
        self.layout = layout
        self.params_dtype = params_dtype
        self.params = torch.zeros(layout.numel, dtype=params_dtype, device=device)
        self.grads = torch.zeros(layout.numel, dtype=torch.float32, device=device)
        self.on_ready: Callable[[int], None] | None = None  # bucket index -> None
        for index, bucket in enumerate(layout.buckets):
            for p in bucket.params:
                self._bind(p, layout.offset_of(p), index)

    def _bind(self, p: nn.Parameter, offset: int, bucket: int) -> None:
        bind(p, self.params[offset:offset + p.numel()], get_meta(p).init)
        p.main_grad = self.grads[offset:offset + p.numel()].view_as(p)
        if p.dtype == torch.float32:
            p.grad = p.main_grad
        p.register_post_accumulate_grad_hook(lambda param: self._on_grad(param, bucket))

    def _on_grad(self, param: nn.Parameter, bucket: int) -> None:
        if param.grad is not param.main_grad:  # low precision: accumulate in fp32
            param.main_grad.add_(param.grad)
            param.grad = None
        if self.on_ready is not None:
            self.on_ready(bucket)

    def zero_grad(self) -> None:
        self.grads.zero_()
