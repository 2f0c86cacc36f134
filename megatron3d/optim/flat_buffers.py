"""Contiguous buffers behind the model's parameters and their fp32 gradients.

Every parameter becomes a view into one flat buffer of the model dtype, and its gradient
(``param.main_grad``) a view into one flat fp32 buffer with the same layout. The optimizer,
clipping, zeroing and (later) data-parallel reduction then work on a few large tensors instead
of hundreds of small ones, and ZeRO shards the same flat layout across ranks.

fp32 models: ``param.grad`` *is* the main_grad view, so autograd accumulates micro-batches in
place with no copy. bf16/fp16 models: a post-accumulate hook adds each low-precision gradient
into the fp32 main_grad and frees it, so accumulation across micro-batches happens in fp32.

The layout is grouped into segments by (counted in the grad norm, weight decay): counted
parameters come first, so the counted gradients are one prefix of the grad buffer.
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


def _add_into_main_grad(param: torch.Tensor) -> None:
    param.main_grad.add_(param.grad)
    param.grad = None


class FlatBuffers:
    """Owns the flat parameter buffer and the flat fp32 gradient buffer of some parameters.

    ``counted(param)`` says whether this rank counts the parameter in the global grad norm
    (False for copies another rank also counts: TP replicas off TP rank 0, tied copies).
    """

    def __init__(self, params: list[nn.Parameter],
                 counted: Callable[[nn.Parameter], bool] = lambda p: True) -> None:
        dtypes = {p.dtype for p in params}
        assert len(dtypes) == 1, f"one parameter dtype per model, got {dtypes}"
        self.params_dtype = dtypes.pop()
        device = params[0].device
        ordered = sorted(params, key=lambda p: (not counted(p), get_meta(p).no_weight_decay))
        total = sum(p.numel() for p in ordered)
        self.params = torch.empty(total, dtype=self.params_dtype, device=device)
        self.grads = torch.zeros(total, dtype=torch.float32, device=device)
        self.segments = self._attach(ordered, counted)
        self.counted_numel = sum(s.end - s.start for s in self.segments if s.counted)

    def _attach(self, ordered: list[nn.Parameter],
                counted: Callable[[nn.Parameter], bool]) -> list[Segment]:
        segments: list[Segment] = []
        offset, seg_start, seg_key, seg_names = 0, 0, None, []
        for p in ordered:
            key = (counted(p), get_meta(p).no_weight_decay)
            if key != seg_key and seg_names:
                segments.append(Segment(seg_start, offset, seg_key[1], seg_key[0],
                                        tuple(seg_names)))
                seg_start, seg_names = offset, []
            seg_key = key
            seg_names.append(get_meta(p).name)
            self._bind(p, offset)
            offset += p.numel()
        if seg_names:
            segments.append(Segment(seg_start, offset, seg_key[1], seg_key[0], tuple(seg_names)))
        return segments

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

    @property
    def counted_grads(self) -> torch.Tensor:
        """The prefix of the grad buffer this rank counts in the global norm."""
        return self.grads[: self.counted_numel]
