"""Bad steps injected from outside the framework (``Overrides``), for --rerun-on-bad-step: a
transient fault on one rank's local gradients or loss in one pass, and a sample whose loss is
always NaN (bad data: every pass that reads it fails alike)."""

from __future__ import annotations

from typing import Any

import torch

from megatron3d.data.sampler import MicroBatch
from megatron3d.pipeline.engine import PipelineEngine
from megatron3d.training.grad_sync import GradSync


class NaNBeforeReduce:
    """Wraps a ZeRO-0/1 trainer's ``GradSync``: in its ``at``-th forward/backward pass (a
    re-run counts as a pass), just before the last backward, the first element of this rank's
    local gradient buffer becomes NaN on ``on_rank`` only: the fault is in what this rank
    contributes to the data-parallel reduction, and the reduction spreads it to its peers."""

    def __init__(self, inner: GradSync, at: set[int], on_rank: bool) -> None:
        self.inner, self.at, self.on_rank = inner, at, on_rank
        self.passes = 0

    def before_last_backward(self, chunk: int) -> None:
        if self.passes + 1 in self.at and self.on_rank:
            self.inner.data_parallel.buffers.grads[0] = float("nan")
        self.inner.before_last_backward(chunk)

    def __call__(self) -> None:
        self.inner()
        self.passes += 1


class _Engine:
    """The engine, unchanged but for ``forward_backward`` (which subclasses wrap)."""

    def __init__(self, inner: PipelineEngine) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class SpikeOnce(_Engine):
    """The loss this rank reports from its ``at``-th pass is ``factor`` times larger on
    ``on_rank`` (a transient fault in the loss, not in the gradients)."""

    def __init__(self, inner: PipelineEngine, at: int, on_rank: bool, factor: float) -> None:
        super().__init__(inner)
        self.at, self.on_rank, self.factor = at, on_rank, factor
        self.passes = 0

    def forward_backward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        loss = self.inner.forward_backward(*args, **kwargs)
        self.passes += 1
        return loss * self.factor if self.passes == self.at and self.on_rank else loss


def _holds(batch: MicroBatch, tokens: torch.Tensor) -> bool:
    """Whether one of the micro-batch's samples has the input tokens ``tokens``."""
    if not isinstance(batch, MicroBatch):  # a middle stage's unread batch
        return False
    return bool((batch.tokens == tokens.to(batch.tokens.device)).all(dim=1).any())


class PoisonedSample(_Engine):
    """Every micro-batch holding a sample whose input tokens are ``tokens`` gets a NaN loss
    mask, so its loss and gradients are NaN at every pass: a data fault, on whichever
    data-parallel rank reads the sample."""

    def __init__(self, inner: PipelineEngine, tokens: torch.Tensor) -> None:
        super().__init__(inner)
        self.tokens = tokens
        self.hits = 0

    def forward_backward(self, batches: list, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.inner.forward_backward([self._poisoned(b) for b in batches], *args,
                                           **kwargs)

    def _poisoned(self, batch: MicroBatch) -> MicroBatch:
        if not _holds(batch, self.tokens):
            return batch
        self.hits += 1
        return MicroBatch(batch.tokens, batch.labels, torch.full_like(batch.loss_mask, torch.nan))


class SpikySample(_Engine):
    """A pass whose micro-batches hold the sample ``tokens`` has its loss and gradients
    ``factor`` times larger on this rank, at every pass: a loss spike from the data."""

    def __init__(self, inner: Any, tokens: torch.Tensor, factor: float) -> None:
        super().__init__(inner)
        self.tokens, self.factor = tokens, factor
        self.hits = 0

    def forward_backward(self, batches: list, loss_scale: float, **kwargs: Any) -> torch.Tensor:
        if not any(_holds(b, self.tokens) for b in batches):
            return self.inner.forward_backward(batches, loss_scale, **kwargs)
        self.hits += 1
        return self.inner.forward_backward(batches, loss_scale * self.factor,
                                           **kwargs) * self.factor
