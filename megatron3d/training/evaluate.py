"""Validation and test loss: the same forward path (through the pipeline) without gradients."""

from __future__ import annotations

import math
from collections.abc import Callable

from megatron3d.mpu.state import AxisGroup
from megatron3d.pipeline.engine import Batch, PipelineEngine
from megatron3d.training.step import average_over


def evaluate(engine: PipelineEngine, batches_for: Callable[[int], list[Batch]],
             num_iters: int, dp: AxisGroup) -> float:
    """Mean loss over ``num_iters`` evaluation global batches, meaningful on the last stage
    (one host sync at the end)."""
    engine.stage.eval()
    total = sum(engine.forward_only(batches_for(i)) for i in range(num_iters))
    engine.stage.train()
    return float(average_over(total, dp)) / num_iters


def perplexity(loss: float) -> float:
    """exp(loss), capped as Megatron caps it (at exp(20)) so an early loss stays printable."""
    return math.exp(min(20.0, loss))


def format_eval_line(where: str, loss: float) -> str:
    """Megatron's evaluation block: ``where`` is "iteration N" for the periodic validation,
    "iteration N on validation set" / "... on test set" at the end of a run."""
    body = (f" validation loss at {where} | lm loss value: {loss:.6E} |"
            f" lm loss PPL: {perplexity(loss):.6E} |")
    rule = "-" * len(body)
    return f"{rule}\n{body}\n{rule}"
