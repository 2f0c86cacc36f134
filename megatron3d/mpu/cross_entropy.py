"""Cross entropy over logits whose vocabulary dimension is split across TP ranks.

The full [..., v] logits never exist on one rank: the max, the target logit and the sum of
exponentials are each reduced across TP as [...]-shaped tensors. Columns at or beyond the
logical vocabulary (padding) are masked to -inf, so the padded size never changes the loss.
Computed in fp32 whatever the logits' dtype; the gradient comes back in the logits' dtype.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron3d.mpu import comm
from megatron3d.mpu.state import AxisGroup


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor, tp: AxisGroup,
                logical_vocab_size: int) -> torch.Tensor:
        v_local = logits.shape[-1]
        start = tp.rank * v_local
        n_real = min(max(logical_vocab_size - start, 0), v_local)  # real columns held here

        real = logits[..., :n_real].float()  # [..., n_real]
        if n_real > 0:
            row_max = real.max(dim=-1).values  # [...]
        else:
            row_max = torch.full(logits.shape[:-1], float("-inf"), device=logits.device)
        comm.all_reduce(row_max, tp, op=comm.MAX)

        shifted = torch.empty(logits.shape, dtype=torch.float32,
                              device=logits.device)  # [..., v/tp]
        torch.sub(real, row_max.unsqueeze(-1), out=shifted[..., :n_real])
        shifted[..., n_real:] = float("-inf")

        outside = (labels < start) | (labels >= start + v_local)  # [...]
        local_labels = (labels - start).masked_fill(outside, 0)
        target = shifted.gather(-1, local_labels.unsqueeze(-1)).squeeze(-1)  # [...]
        target = target.masked_fill(outside, 0.0)
        comm.all_reduce(target, tp)

        probs = shifted.exp_()  # [..., v/tp], unnormalised (0 on padding); reuses the buffer
        # Sum the real columns only: the same additions whatever the padding, so the loss is
        # bitwise independent of the padded vocabulary size.
        sum_exp = probs[..., :n_real].sum(dim=-1)  # [...]
        comm.all_reduce(sum_exp, tp)
        loss = torch.log(sum_exp) - target  # [...]

        probs.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(probs, local_labels, outside)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        probs, local_labels, outside = ctx.saved_tensors
        # d loss / d logit_j = softmax_j - [j == label]; only the owner of the label subtracts.
        grad = probs.clone()  # [..., v/tp]
        one_hot = (~outside).to(grad.dtype).unsqueeze(-1)  # [..., 1]
        grad.scatter_add_(-1, local_labels.unsqueeze(-1), -one_hot)
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, tp: AxisGroup,
                                 logical_vocab_size: int) -> torch.Tensor:
    """Per-token loss [...] from logits [..., v_pad/tp] (this rank's columns) and global labels.

    ``labels`` are int64 ids < ``logical_vocab_size``; the loss is fp32.
    """
    return _VocabParallelCrossEntropy.apply(logits, labels, tp, logical_vocab_size)
