"""One training step: the schedule's forward and backward passes, gradient reductions, then
the optimizer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron3d.mpu.state import AxisGroup
from megatron3d.optim.mixed_precision import MixedPrecisionOptimizer, StepStats
from megatron3d.pipeline.engine import Batch, PipelineEngine
from megatron3d.training.grad_sync import GradSync
from megatron3d.zero.reducer import average_over


@dataclass(frozen=True)
class StepResult:
    loss: torch.Tensor  # the global batch's mean loss (on the last stage), on device
    stats: StepStats


def train_step(engine: PipelineEngine, optimizer: MixedPrecisionOptimizer,
               batches: list[Batch], lr: float, grad_sync: GradSync,
               dp: AxisGroup) -> StepResult:
    optimizer.zero_grad()
    loss = engine.forward_backward(batches, optimizer.loss_scale,
                                   before_last_backward=grad_sync.before_last_backward)
    grad_sync()
    return StepResult(loss=average_over(loss, dp), stats=optimizer.step(lr))
