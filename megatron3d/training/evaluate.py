"""Validation loss: the same forward path (through the pipeline) without gradients."""

from __future__ import annotations

import math
from collections.abc import Callable

from megatron3d.mpu.state import AxisGroup
from megatron3d.pipeline.engine import Batch, PipelineEngine
from megatron3d.zero.reducer import average_over


def evaluate(engine: PipelineEngine, batches_for: Callable[[int], list[Batch]],
             num_iters: int, dp: AxisGroup) -> float:
    """Mean loss over ``num_iters`` validation global batches, meaningful on the last stage
    (one host sync at the end)."""
    engine.stage.eval()
    total = sum(engine.forward_only(batches_for(i)) for i in range(num_iters))
    engine.stage.train()
    return float(average_over(total, dp)) / num_iters


def format_eval_line(iteration: int, loss: float) -> str:
    """Megatron's validation block: loss and perplexity."""
    ppl = math.exp(min(20.0, loss))
    body = (f" validation loss at iteration {iteration} | lm loss value: {loss:.6E} |"
            f" lm loss PPL: {ppl:.6E} |")
    rule = "-" * len(body)
    return f"{rule}\n{body}\n{rule}"
