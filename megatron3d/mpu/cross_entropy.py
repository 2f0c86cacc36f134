"""Cross entropy over logits whose vocabulary dimension is split across TP ranks.

The full [..., v] logits never exist on one rank: the max, the target logit and the sum of
exponentials are each reduced across TP as [...]-shaped tensors. Columns at or beyond the
logical vocabulary (padding) are masked to -inf, so the padded size never changes the loss.
Computed in fp32 whatever the logits' dtype; the gradient comes back in the logits' dtype.

Memory: one fp32 buffer of this rank's logits, worked on in place from the copy of the logits
to the gradient (softmax minus the one-hot target, scaled in backward), so the loss holds at
most that buffer plus, in backward, the gradient in the logits' dtype: 1.5x the fp32 logits
for bf16 logits. The buffer is consumed by backward (it becomes the gradient), so the graph
cannot be run backward twice.
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

        buf = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)  # [..., v/tp]
        if n_real == v_local:
            buf.copy_(logits)
        else:
            buf[..., :n_real] = logits[..., :n_real]
            buf[..., n_real:] = float("-inf")
        row_max = torch.amax(buf, dim=-1)  # [...], -inf on a rank of padding only
        comm.all_reduce(row_max, tp, op=comm.MAX)
        buf.sub_(row_max.unsqueeze(-1))

        outside = (labels < start) | (labels >= start + v_local)  # [...]
        local_labels = (labels - start).masked_fill(outside, 0).unsqueeze(-1)  # [..., 1]
        target = buf.gather(-1, local_labels).squeeze(-1).masked_fill(outside, 0.0)  # [...]
        comm.all_reduce(target, tp)

        probs = buf.exp_()  # unnormalised (0 on padding)
        # Sum the real columns only: the same additions whatever the padding, so the loss is
        # bitwise independent of the padded vocabulary size.
        sum_exp = probs[..., :n_real].sum(dim=-1)  # [...]
        comm.all_reduce(sum_exp, tp)
        loss = torch.log(sum_exp) - target  # [...]

        probs.div_(sum_exp.unsqueeze(-1))
        # d loss / d logit_j = softmax_j - [j == label]; only the owner of the label subtracts.
        one_hot = (~outside).to(probs.dtype).unsqueeze(-1)  # [..., 1]
        grad = probs.scatter_add_(-1, local_labels, -one_hot)
        ctx.save_for_backward(grad)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        (grad,) = ctx.saved_tensors
        grad.mul_(grad_loss.unsqueeze(-1))  # the saved buffer becomes the gradient
        return grad.to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, tp: AxisGroup,
                                 logical_vocab_size: int) -> torch.Tensor:
    """Per-token loss [...] from logits [..., v_pad/tp] (this rank's columns) and global labels.

    ``labels`` are int64 ids < ``logical_vocab_size``; the loss is fp32.
    """
    return _VocabParallelCrossEntropy.apply(logits, labels, tp, logical_vocab_size)
