"""Tiny model configurations of each flavour, and command lines that train them."""

from __future__ import annotations

import dataclasses

import torch

from megatron3d.config import ModelConfig
from megatron3d.model.context import LayerContext
from megatron3d.model.gpt import build_gpt, lm_loss
from megatron3d.mpu.meta import get_meta
from megatron3d.mpu.random import RNGStreams
from megatron3d.mpu.state import AxisGroup

_BASE = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 16,
         "vocab_size": 203, "make_vocab_size_divisible_by": 8, "hidden_dropout": 0.0,
         "attention_dropout": 0.0}

FLAVOURS: dict[str, dict] = {
    "gpt2": {},
    "bloom": {"position_embedding_type": "alibi", "embed_layernorm": True},
    "llama": {"position_embedding_type": "rope", "normalization": "rmsnorm", "swiglu": True,
              "untie_embeddings_and_output_weights": True, "disable_bias_linear": True},
}

FLAVOUR_FLAGS: dict[str, list[str]] = {
    "gpt2": [],
    "bloom": ["--position-embedding-type", "alibi", "--embed-layernorm"],
    "llama": ["--position-embedding-type", "rope", "--normalization", "rmsnorm", "--swiglu",
              "--untie-embeddings-and-output-weights", "--disable-bias-linear"],
}


def model_config(flavour: str = "gpt2", **overrides) -> ModelConfig:
    return ModelConfig(**{**_BASE, **FLAVOURS[flavour], **overrides})


def layer_context(cfg: ModelConfig, seed: int = 1234, tp: AxisGroup | None = None,
                  dtype: torch.dtype = torch.float32) -> LayerContext:
    return LayerContext(cfg, tp or AxisGroup.single(), seed, dtype, torch.device("cpu"))


def replace(cfg: ModelConfig, **changes) -> ModelConfig:
    return dataclasses.replace(cfg, **changes)


def two_micro_batches(cfg: ModelConfig, seed: int = 1234) -> tuple[list, dict, RNGStreams]:
    """One process: the whole model forward and backward on two seeded micro-batches of 3
    sequences, with its dropout streams: (losses, gradients by logical name, the streams)."""
    cpu = torch.device("cpu")
    rng = RNGStreams.create(seed, tp_rank=0, pp_rank=0, dev=cpu)
    ctx = LayerContext(cfg, AxisGroup.single(), seed, torch.float32, cpu, rng)
    model = build_gpt(ctx).train()
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(2):
        data = torch.randint(0, cfg.vocab_size, (3, cfg.seq_length + 1), generator=gen)
        loss = lm_loss(model(data[:, :-1]), data[:, 1:], torch.ones(3, cfg.seq_length), ctx)
        loss.backward()
        losses.append(loss.detach())
    return losses, {get_meta(p).name: p.grad for p in model.parameters()}, rng


def train_argv(flavour: str = "gpt2", iters: int = 10, *extra: str) -> list[str]:
    """A pretrain_gpt.py command line for a tiny run on mock data."""
    return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
            "--train-iters", str(iters), "--lr", "3e-3", "--min-lr", "3e-4",
            "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--mock-data",
            "--vocab-size", "203", "--make-vocab-size-divisible-by", "8",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1",
            "--eval-interval", "1000", "--eval-iters", "1", *FLAVOUR_FLAGS[flavour], *extra]


def ramp_argv(flavour: str, iters: int, ramp: tuple[str, ...], *extra: str) -> list[str]:
    """``train_argv`` whose global batch ramps: ``ramp`` is (G, START, INCR, SAMPLES)."""
    return train_argv(flavour, iters, "--global-batch-size", ramp[0], "--rampup-batch-size",
                      *ramp[1:], *extra)
