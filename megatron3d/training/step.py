"""One training step: the schedule's forward and backward passes, gradient reductions, then
the optimizer; and the --check-for-nan-in-loss-and-grad stop after it. ``compute_gradients``
is the part before the optimizer, which --rerun-on-bad-step (``rerun.py``) judges and may
run twice before it lets the optimizer apply it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron3d.device import ComputeSpans
from megatron3d.errors import TrainingError
from megatron3d.mpu import comm
from megatron3d.mpu.state import AxisGroup
from megatron3d.optim.mixed_precision import MixedPrecisionOptimizer, StepStats
from megatron3d.pipeline.engine import Batch, PipelineEngine
from megatron3d.training.grad_sync import GradSync


@dataclass(frozen=True)
class StepResult:
    loss: torch.Tensor  # the global batch's mean loss (on the last stage), on device
    stats: StepStats


def train_step(engine: PipelineEngine, optimizer: MixedPrecisionOptimizer,
               batches: list[Batch], lr: float, grad_sync: GradSync,
               dp: AxisGroup, spans: ComputeSpans | None = None) -> StepResult:
    """``spans`` times the forward and backward passes (the straggler watch's compute time),
    not the reductions waited for after them."""
    loss = compute_gradients(engine, optimizer, batches, grad_sync, dp, spans)
    return StepResult(loss=loss, stats=optimizer.step(lr))


def compute_gradients(engine: PipelineEngine, optimizer: MixedPrecisionOptimizer,
                      batches: list[Batch], grad_sync: GradSync, dp: AxisGroup,
                      spans: ComputeSpans | None = None) -> torch.Tensor:
    """Zero the gradients, run the forward and backward passes and every gradient reduction;
    the global batch's loss (``average_over``), on the device."""
    optimizer.zero_grad()
    if spans is not None:
        spans.begin()
    loss = engine.forward_backward(batches, optimizer.loss_scale,
                                   before_last_backward=grad_sync.before_last_backward)
    if spans is not None:
        spans.end()
    grad_sync()
    return average_over(loss, dp)


def average_over(loss: torch.Tensor, dp: AxisGroup) -> torch.Tensor:
    """The mean of ``loss`` over data-parallel ranks: the global batch's loss (the pipeline
    engine returns this rank's share on the last stage)."""
    if dp.size == 1:
        return loss
    return comm.all_reduce(loss.clone(), dp) / dp.size


def check_grad_norm(stats: StepStats, iteration: int) -> None:
    """Raise if the step was skipped for a NaN/Inf global grad norm (bf16/fp32; fp16
    overflows are the loss scaler's to handle). The flag is agreed over all ranks, so every
    rank raises; a non-finite loss makes the gradients non-finite, so this covers it. Costs a
    host sync per step, which is why it is opt-in."""
    if float(stats.nan) == 0.0:
        return
    raise TrainingError(
        f"global gradient norm is {float(stats.grad_norm)} at iteration {iteration}: training "
        "stopped by --check-for-nan-in-loss-and-grad; resume from the last checkpoint with a "
        "lower --lr, or drop the flag to skip such steps")
