"""Count the collectives and point-to-point messages one rank issues, whatever framework
issues them.

Every framework here ends in the same place: `torch.distributed`'s c10d operators (DDP's
C++ reducer, FSDP2, pipelining, DeepSpeed's and Megatron-Core's wrappers) or the functional
collectives DTensor uses. A dispatch mode sees each of those calls once, so one counter
serves every row without touching any framework's code. It costs Python work on every
operator, so it runs for one warm-up step only (``record.StepClock``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

_NAMESPACES = ("c10d", "_c10d_functional")
_NOT_MESSAGES = ("wait_tensor", "_wrap_tensor_autograd")
"""Functional-collective bookkeeping operators that move no data."""


@dataclass
class CommTally:
    calls: int = 0
    bytes: int = 0


def message_bytes(args: tuple, out: object) -> int:
    """A call's size as nccl-tests counts it: its largest buffer (the gathered output of an
    all-gather, the input of a reduce-scatter, the one buffer of an all-reduce, send or
    receive). Each argument's tensors are summed, so a coalesced call counts all of them."""
    sizes = [_tensor_bytes(a) for a in args] + [_tensor_bytes(out)]
    return max(sizes, default=0)


def _tensor_bytes(tree: object) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(tree)
               if isinstance(t, torch.Tensor))


class CommCounter(TorchDispatchMode):
    """While entered, tallies every collective and p2p operator this thread dispatches."""

    def __init__(self) -> None:
        super().__init__()
        self.tally = CommTally()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace in _NAMESPACES and func._opname not in _NOT_MESSAGES:
            self.tally.calls += 1
            self.tally.bytes += message_bytes(args, out)
        return out
