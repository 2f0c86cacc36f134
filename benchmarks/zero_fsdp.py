"""The PyTorch FSDP2 baseline of ``zero.py``, and a counter of the collectives torch issues.

FSDP2 (``torch.distributed.fsdp.fully_shard``) shards ``build_gpt``'s model (identical initial
weights to megatron3d's: init depends only on seed and names) over a CPU device mesh: one
``fully_shard`` per transformer block, then one on the root (embedding, final norm, tied LM
head). Defaults as megatron3d's ZeRO-3: parameters resharded after forward, gradients
reduce-scattered after every micro-batch's backward. Same batches, the same two AdamW groups
(chosen by the parameters' metadata before sharding, matched by name after), clipping, loss.
"""

from __future__ import annotations

import contextlib
import functools
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from megatron3d.accounting import memory
from megatron3d.config import TrainConfig
from megatron3d.model.context import LayerContext
from megatron3d.model.gpt import build_gpt
from megatron3d.model.transformer import TransformerLayer
from megatron3d.mpu.meta import get_meta
from megatron3d.mpu.state import AxisGroup

# (module, attribute, counted kind, the argument that is this rank's input)
_PATCHED = [(dist, "all_gather_single", "all_gather", 1),
            (dist, "all_gather_into_tensor", "all_gather", 1),
            (dist, "reduce_scatter_single", "reduce_scatter", 1),
            (dist, "reduce_scatter_tensor", "reduce_scatter", 1),
            (dist, "all_reduce", "all_reduce", 0),
            (dist, "broadcast", "broadcast", 0),
            (funcol, "all_reduce", "all_reduce", 0),
            (funcol, "all_gather_tensor", "all_gather", 0),
            (funcol, "reduce_scatter_tensor", "reduce_scatter", 0)]
"""Every torch entry point FSDP2 and DTensor (the clipping norm) reach on this torch; looked
up as module attributes at call time, so replacing them for a block counts each call."""


class TorchCounter:
    """Calls and bytes (this rank's input) per collective kind, as ``CommCounter`` does."""

    def __init__(self) -> None:
        self.calls: defaultdict[str, int] = defaultdict(int)
        self.bytes: defaultdict[str, int] = defaultdict(int)

    @contextlib.contextmanager
    def counting(self) -> Iterator[TorchCounter]:
        """Count the collectives torch.distributed issues inside the block (benchmark only)."""
        originals = [(module, name, getattr(module, name)) for module, name, _, _ in _PATCHED]
        for (module, name, kind, arg), (_, _, original) in zip(_PATCHED, originals,
                                                              strict=True):
            setattr(module, name, self._wrap(original, kind, arg))
        try:
            yield self
        finally:
            for module, name, original in originals:
                setattr(module, name, original)

    def _wrap(self, original: Callable[..., Any], kind: str, arg: int) -> Callable[..., Any]:
        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            tensor = args[arg] if len(args) > arg else kwargs.get("input", kwargs.get("tensor"))
            if isinstance(tensor, DTensor):
                tensor = tensor.to_local()
            self.calls[kind] += 1
            if torch.is_tensor(tensor):
                self.bytes[kind] += tensor.numel() * tensor.element_size()
            return original(*args, **kwargs)

        return counted


def plain_gpt(cfg: TrainConfig) -> nn.Module:
    """``build_gpt``'s whole fp32 model on the CPU, in training mode, for the torch peers:
    the same initial weights as megatron3d's (initialisation depends on seed and names)."""
    ctx = LayerContext(cfg.model, AxisGroup.single(), cfg.training.seed, torch.float32,
                       torch.device("cpu"))
    return build_gpt(ctx).train()


def clip_and_step(model: nn.Module, opt: torch.optim.Optimizer, clip: float, lr: float) -> None:
    """The torch peers' optimizer step: global-norm clipping, then AdamW at ``lr``."""
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=True)
    for group in opt.param_groups:
        group["lr"] = lr
    opt.step()


class FsdpRun:
    """FSDP2 around ``build_gpt``'s model on a CPU mesh of every rank, AdamW."""

    def __init__(self, cfg: TrainConfig, dp: int) -> None:
        model = plain_gpt(cfg)
        no_decay = {name for name, p in model.named_parameters()
                    if get_meta(p).no_weight_decay}
        mesh = init_device_mesh("cpu", (dp,))
        for layer in model.layers:
            if isinstance(layer, TransformerLayer):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model = model
        opt = cfg.optimizer
        named = list(model.named_parameters())
        groups = [{"params": [p for n, p in named if n not in no_decay],
                   "weight_decay": opt.weight_decay},
                  {"params": [p for n, p in named if n in no_decay], "weight_decay": 0.0}]
        self.opt = torch.optim.AdamW(groups, lr=opt.lr, betas=(opt.adam_beta1, opt.adam_beta2),
                                     eps=opt.adam_eps, foreach=True)
        self.clip, self.vocab = opt.clip_grad, cfg.model.vocab_size
        self.num_params = sum(p.numel() for p in model.parameters())  # DTensor: global

    def step(self, lr: float, batches: list) -> torch.Tensor:
        """Mean micro-batch loss's gradients (reduce-scattered per micro-batch), clip, step."""
        self.opt.zero_grad(set_to_none=True)
        total = torch.zeros(())
        for b in batches:
            logits = self.model(b.tokens)[..., :self.vocab]  # [s, b, v]
            loss = F.cross_entropy(logits.float().flatten(0, 1), b.labels.t().flatten())
            (loss / len(batches)).backward()
            total += loss.detach()
        clip_and_step(self.model, self.opt, self.clip, lr)
        return total / len(batches)

    def memory(self, dp: int) -> tuple[memory.MemoryBytes, memory.MemoryBytes]:
        """This rank's shards of parameters, gradients and Adam moments (the all-gather
        buffers FSDP2 allocates per use are transient, so not counted); ideal: ZeRO-3's
        formula without slot buffers."""
        params = list(self.model.parameters())
        moments = sum(_local(t).nbytes for s in self.opt.state.values() for t in s.values()
                      if torch.is_tensor(t) and t.dim() > 0)
        measured = memory.MemoryBytes(params=sum(_local(p).nbytes for p in params),
                                      grads=sum(_local(p.grad).nbytes for p in params
                                                if p.grad is not None),
                                      optimizer_state=moments)
        return measured, memory.analytic(self.num_params, 4, 3, dp)

    def final_params(self) -> dict[str, torch.Tensor]:
        """Full parameter values by name (all-gathered; after training only)."""
        return {name: p.full_tensor().detach().clone()
                for name, p in self.model.named_parameters()}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t
