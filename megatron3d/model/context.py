"""What every layer needs to build itself: the model config, the TP axis, seed, dtype, device.

Passed explicitly to each layer (no globals), and picklable into a LayerSpec so a pipeline
stage can build its layers alone.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from megatron3d.config import ModelConfig
from megatron3d.mpu.random import RNGStreams
from megatron3d.mpu.state import AxisGroup


@dataclass(frozen=True)
class LayerContext:
    """``rng``: the model-parallel dropout stream; None runs all dropout on the default
    stream (fine for a single process, wrong across TP ranks)."""

    cfg: ModelConfig
    tp: AxisGroup
    seed: int
    params_dtype: torch.dtype = torch.float32
    device: torch.device | None = None
    rng: RNGStreams | None = None
    sequence_parallel: bool = False

    def tp_region_rng(self) -> contextlib.AbstractContextManager:
        """Where dropout acts on TP-split activations: a stream that differs per TP rank."""
        return self.rng.fork() if self.rng is not None else contextlib.nullcontext()

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

    def sequence_shard_rng(self) -> contextlib.AbstractContextManager:
        """Dropout on activations: sequence-sharded ones (SP) differ per TP rank, replicated
        ones must draw the same mask on every TP rank (the shared default stream)."""
        return self.tp_region_rng() if self.sequence_parallel else contextlib.nullcontext()

    def linear_kwargs(self) -> dict:
        """Keyword arguments of the parallel linear layers."""
        return {**self.layer_kwargs(), "sequence_parallel": self.sequence_parallel}

    def layer_kwargs(self) -> dict:
        """Keyword arguments shared by every mpu parallel layer."""
        return {"tp": self.tp, "seed": self.seed, "params_dtype": self.params_dtype,
                "device": self.device}
