"""AdamW and gradient clipping for the PyTorch rows, with megatron3d's rules: no weight decay
on biases and norm weights (the 1-D tensors), the global norm counting each logical weight
once, and Megatron's clip factor ``max / (norm + 1e-6)`` applied only when below 1."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from benchmarks.peers.config import PeerConfig


def adamw(cfg: PeerConfig, params: list[nn.Parameter]) -> torch.optim.AdamW:
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)


def _owned_square(grad: torch.Tensor, replica_rank: int) -> torch.Tensor:
    """This rank's share of ``|grad|^2``: all of its shard of a sharded DTensor; a whole
    (replicated) tensor only on rank 0 of the ranks that replicate it."""
    if isinstance(grad, DTensor):
        if any(p.is_shard() for p in grad.placements):
            return grad.to_local().pow(2).sum()
        grad = grad.to_local()
    return grad.pow(2).sum() if replica_rank == 0 else grad.new_zeros(())


def clip_grads(params: list[nn.Parameter], max_norm: float, group: dist.ProcessGroup | None,
               replica_rank: int = 0, copies: tuple[nn.Parameter, ...] = ()) -> float:
    """Clip the gradients of ``params`` to a global norm of ``max_norm``; returns the norm.
    ``group``: the ranks whose shares add up to the whole model (None: this rank holds all
    of it); ``replica_rank``: this rank's index among the ranks that hold whole replicas;
    ``copies``: parameters of ``params`` that are clipped but not counted (a tied copy whose
    original another rank counts)."""
    grads = [p.grad for p in params if p.grad is not None]
    counted = [p.grad for p in params if p.grad is not None and not _is_in(p, copies)]
    total = torch.stack([_owned_square(g, replica_rank) for g in counted]).sum()
    if group is not None:
        dist.all_reduce(total, group=group)
    norm = float(total.sqrt())
    factor = max_norm / (norm + 1e-6)
    if factor < 1.0:
        for g in grads:
            g.mul_(factor)
    return norm


def _is_in(p: nn.Parameter, params: tuple[nn.Parameter, ...]) -> bool:
    return any(p is q for q in params)
