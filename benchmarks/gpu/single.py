"""megatron3d on one device, as ``pretrain_gpt.py`` would run it there: the shapes the speed,
memory and profile sections train, the process group of one rank, the trainer."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from megatron3d import device as devices
from megatron3d.cli.arguments import parse_args
from megatron3d.mpu.meta import get_meta
from megatron3d.mpu.sharding import gather_logical
from megatron3d.mpu.state import ParallelState
from megatron3d.training.build import Overrides, build_trainer
from megatron3d.training.loop import Hooks, Trainer
from megatron3d.training.step import StepResult
from megatron3d.validation import validate

SEED = 1234


@dataclass(frozen=True)
class Shape:
    """A GPT and its batches: ``global_batch`` samples per step in micro-batches."""

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    micro_batch: int
    global_batch: int

    def describe(self) -> str:
        return (f"{self.layers} layers, hidden {self.hidden}, {self.heads} heads, seq "
                f"{self.seq}, vocabulary {self.vocab}, {self.global_batch} samples per step "
                f"in micro-batches of {self.micro_batch}")


GPT_1_3B = Shape(24, 2048, 16, 2048, 50257, 4, 16)
GPT_125M = Shape(12, 768, 12, 1024, 50257, 4, 8)
TINY = Shape(2, 64, 4, 64, 512, 2, 4)
LR, WEIGHT_DECAY, CLIP = 1e-4, 0.1, 1.0


def argv(shape: Shape, steps: int, *extra: str) -> list[str]:
    """bf16 training on mock data, a constant learning rate, no dropout, no evaluation,
    one log line at the end."""
    flags = ["--num-layers", shape.layers, "--hidden-size", shape.hidden,
             "--num-attention-heads", shape.heads, "--seq-length", shape.seq,
             "--max-position-embeddings", shape.seq, "--vocab-size", shape.vocab,
             "--make-vocab-size-divisible-by", 128, "--mock-data", "--seed", SEED,
             "--micro-batch-size", shape.micro_batch, "--global-batch-size", shape.global_batch,
             "--train-iters", steps, "--lr", LR, "--min-lr", LR, "--lr-decay-style",
             "constant", "--lr-warmup-iters", 0, "--weight-decay", WEIGHT_DECAY,
             "--clip-grad", CLIP, "--hidden-dropout", 0, "--attention-dropout", 0,
             "--eval-iters", 0, "--eval-interval", 10**6, "--log-interval", steps, "--bf16"]
    return [str(f) for f in flags] + list(extra)


@contextlib.contextmanager
def process_group() -> Iterator[None]:
    """One rank's process group (on a GPU NCCL, as ``pretrain_gpt.py`` would pick)."""
    devices.init_process_group(devices.LaunchEnv(0, 1, 0, launched=False))
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


def build(flags: list[str], dev: torch.device,
          on_step: Callable[[int, StepResult], None] | None = None) -> tuple[Trainer,
                                                                               ParallelState]:
    """The trainer of ``flags`` on ``dev`` (inside ``process_group``)."""
    cfg = parse_args(flags)
    validate(cfg, 1)
    state = ParallelState.build(1, 1)
    return build_trainer(cfg, state, dev, overrides=Overrides(hooks=Hooks(on_step=on_step))), \
        state


def host_weights(trainer: Trainer, state: ParallelState) -> dict[str, torch.Tensor]:
    """Every logical weight, copied to host memory (the device holds the run's state)."""
    weights: dict[str, torch.Tensor] = {}

    def grab(group: list) -> None:
        weights.update((get_meta(p).name, gather_logical(p, state.tp).to("cpu", copy=True))
                       for p in group)

    trainer.model.data_parallel.materialize(grab)
    return weights
