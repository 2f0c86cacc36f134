"""One training step: forward and backward over this rank's micro-batches, then the optimizer.

``forward_backward`` is the no-pipeline schedule; the pipeline engine provides another with
the same contract (accumulate gradients of the mean micro-batch loss, return that mean), so
the rest of the step does not change when pipelining is on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from megatron3d.data.sampler import MicroBatch
from megatron3d.optim.mixed_precision import MixedPrecisionOptimizer, StepStats

LossFn = Callable[[torch.Tensor, MicroBatch], torch.Tensor]
"""(model output, micro-batch) -> the micro-batch's mean loss, an fp32 scalar."""


@dataclass(frozen=True)
class StepResult:
    loss: torch.Tensor  # mean loss over the step's micro-batches, detached, on device
    stats: StepStats


def forward_backward(model: nn.Module, batches: list[MicroBatch], loss_fn: LossFn,
                     loss_scale: float) -> torch.Tensor:
    """Backpropagate ``loss_scale * mean(micro-batch losses)`` one micro-batch at a time."""
    total = torch.zeros((), dtype=torch.float32, device=batches[0].tokens.device)
    weight = loss_scale / len(batches)
    for batch in batches:
        loss = loss_fn(model(batch.tokens), batch)
        (loss * weight).backward()
        total += loss.detach()
    return total / len(batches)


def train_step(model: nn.Module, optimizer: MixedPrecisionOptimizer,
               batches: list[MicroBatch], loss_fn: LossFn, lr: float,
               sync_grads: Callable[[], None] = lambda: None) -> StepResult:
    """``sync_grads`` completes gradient reductions between backward and the optimizer
    (sequence-parallel replicated parameters over TP)."""
    optimizer.zero_grad()
    loss = forward_backward(model, batches, loss_fn, optimizer.loss_scale)
    sync_grads()
    return StepResult(loss=loss, stats=optimizer.step(lr))
