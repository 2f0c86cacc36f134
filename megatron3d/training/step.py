"""One training step: the schedule's forward and backward passes, then the optimizer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron3d.optim.mixed_precision import MixedPrecisionOptimizer, StepStats
from megatron3d.pipeline.engine import Batch, PipelineEngine


@dataclass(frozen=True)
class StepResult:
    loss: torch.Tensor  # mean micro-batch loss (on the last stage), detached, on device
    stats: StepStats


def train_step(engine: PipelineEngine, optimizer: MixedPrecisionOptimizer,
               batches: list[Batch], lr: float,
               sync_grads: Callable[[], None] = lambda: None) -> StepResult:
    """``sync_grads`` completes gradient reductions between backward and the optimizer
    (sequence-parallel replicated parameters over TP, tied embeddings over PP)."""
    optimizer.zero_grad()
    loss = engine.forward_backward(batches, optimizer.loss_scale)
    sync_grads()
    return StepResult(loss=loss, stats=optimizer.step(lr))
