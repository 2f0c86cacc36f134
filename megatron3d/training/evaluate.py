"""Validation loss: the same forward path with dropout off and no gradients."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from megatron3d.data.sampler import MicroBatch
from megatron3d.training.step import LossFn


def evaluate(model: nn.Module, batches_for: Callable[[int], list[MicroBatch]], num_iters: int,
             loss_fn: LossFn) -> float:
    """Mean loss over ``num_iters`` validation global batches (one host sync at the end)."""
    model.eval()
    total = None
    count = 0
    with torch.no_grad():
        for i in range(num_iters):
            for batch in batches_for(i):
                loss = loss_fn(model(batch.tokens), batch)
                total = loss if total is None else total + loss
                count += 1
    model.train()
    return float(total) / count


def format_eval_line(iteration: int, loss: float) -> str:
    """Megatron's validation block: loss and perplexity."""
    ppl = math.exp(min(20.0, loss))
    body = (f" validation loss at iteration {iteration} | lm loss value: {loss:.6E} |"
            f" lm loss PPL: {ppl:.6E} |")
    rule = "-" * len(body)
    return f"{rule}\n{body}\n{rule}"
