"""What every layer needs to build itself: the model config, the TP axis, seed, dtype, device.

Passed explicitly to each layer (no globals), and picklable into a LayerSpec so a pipeline
stage can build its layers alone. What the layers of a rank share (the ALiBi bias) hangs off
the one context they are all built from.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import torch

from megatron3d.config import ModelConfig
from megatron3d.model.compiled import eager
from megatron3d.model.positional import AlibiBias, alibi_slopes
from megatron3d.mpu.random import RNGStreams
from megatron3d.mpu.state import AxisGroup

T = TypeVar("T")


@dataclass(frozen=True)
class LayerContext:
    """``rng``: the model-parallel dropout stream; None runs all dropout on the default
    stream (fine for a single process, wrong across TP ranks). ``draw_weights``: False when a
    checkpoint will fill the weights (--load): they start at zero and nothing is drawn.
    ``defer_init``: parameters are built on the meta device, without storage; the ZeRO
    stage allocates it and draws each rank's share there (``mpu/init.py``). ``cp``: the
    context-parallel axis this rank's sequence shard is part of, exchanged in attention as
    ``cp_comm_type`` says (``cp/attention.py``)."""

    cfg: ModelConfig
    tp: AxisGroup
    seed: int
    params_dtype: torch.dtype = torch.float32
    device: torch.device | None = None
    rng: RNGStreams | None = None
    sequence_parallel: bool = False
    draw_weights: bool = True
    defer_init: bool = False
    cp: AxisGroup = AxisGroup.single()
    cp_comm_type: str = "p2p"

    def on_tp_stream(self, fn: Callable[..., T], *args: object, draws: bool = True) -> T:
        """``fn(*args)`` with its dropout drawn from a stream that differs per TP rank (where
        dropout acts on TP-split activations), ``draws`` saying whether it draws at all.
        Under --compile at TP = 1 the default stream serves, with no switch to break the
        compiled layer (``model/compiled.py``)."""
        if not self.switches_stream(draws):
            return fn(*args)
        return _on_stream(self.rng, fn, *args)

    def switches_stream(self, draws: bool) -> bool:
        """Whether ``on_tp_stream`` swaps generators (host-side work, eager under --compile)."""
        return self.rng is not None and draws and not (self.cfg.compile and self.tp.size == 1)

    @property
    def param_device(self) -> torch.device | None:
        """Where parameters are created (buffers such as RoPE tables go on ``device``)."""
        return torch.device("meta") if self.defer_init else self.device

    @property
    def init_std(self) -> float:
        return self.cfg.init_method_std

    @property
    def output_init_std(self) -> float:
        """Megatron scales projections that feed the residual stream by 1/sqrt(2 * layers)."""
        return self.cfg.init_method_std / math.sqrt(2.0 * self.cfg.num_layers)

    @property
    def padded_vocab_size(self) -> int:
        return self.cfg.padded_vocab_size(self.tp.size)

    @functools.cached_property
    def alibi(self) -> AlibiBias:
        """The ALiBi bias of this TP rank's heads, built once for all layers of the rank."""
        heads = self.cfg.num_attention_heads // self.tp.size
        first = self.tp.rank * heads
        return AlibiBias(alibi_slopes(self.cfg.num_attention_heads)[first:first + heads])

    def hidden_dropout(self, x: torch.Tensor, training: bool) -> torch.Tensor:
        """``--hidden-dropout`` on the residual stream. Sequence-sharded activations (SP)
        differ per TP rank, so their masks do too (``on_tp_stream``); replicated ones must
        draw the same mask on every TP rank (the shared default stream).

        ``native_dropout`` draws the mask ``F.dropout`` would, but keeps it for backward as
        one byte per element on every device (``F.dropout`` on the CPU keeps it in the
        activation's dtype, and its bf16 backward scales by a rounded 1/(1-p)).
        """
        p = self.cfg.hidden_dropout
        if not training or p == 0.0:
            return x
        if self.sequence_parallel:
            return self.on_tp_stream(_dropout, x, p)
        return _dropout(x, p)

    def recompute_contexts(self) -> tuple[contextlib.AbstractContextManager, ...]:
        """``context_fn`` for torch's checkpoint, called at forward time: the checkpoint
        replays the default generator itself; this replays the TP dropout stream."""
        if self.rng is None:
            return contextlib.nullcontext(), contextlib.nullcontext()
        return contextlib.nullcontext(), _replay(self.rng, self.rng.stream_states())

    def linear_kwargs(self) -> dict:
        """Keyword arguments of the parallel linear layers."""
        return {**self.layer_kwargs(), "sequence_parallel": self.sequence_parallel}

    def layer_kwargs(self) -> dict:
        """Keyword arguments shared by every mpu parallel layer."""
        return {"tp": self.tp, "seed": self.seed, "params_dtype": self.params_dtype,
                "device": self.param_device, "draw_weights": self.draw_weights}


def _dropout(x: torch.Tensor, p: float) -> torch.Tensor:
    return torch.native_dropout(x, p, True)[0]


@eager
def _on_stream(rng: RNGStreams, fn: Callable[..., T], *args: object) -> T:
    """A stream switch is a host-side swap of the default generator: eager under --compile,
    a boundary between the layer's compiled regions."""
    with rng.fork():
        return fn(*args)


@contextlib.contextmanager
def _replay(rng: RNGStreams, states: dict[str, torch.Tensor]) -> Iterator[None]:
    """Run the recompute from the streams' forward-time states, then restore where they are."""
    current = rng.stream_states()
    rng.set_stream_states(states)
    try:
        yield
    finally:
        rng.set_stream_states(current)
