"""How the model is trained: batches, run length, optimizer, LR schedule, precision."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron3d.config.ranges import (
    AT_LEAST_ONE,
    BATCH,
    FRACTION,
    ITERATIONS,
    LEARNING_RATE,
    LOSS_SCALE,
    NON_NEGATIVE,
    POSITIVE,
    PROBABILITY,
    SAMPLES,
    SEED,
    SIZE,
    Range,
    option,
)

LRDecayStyle = Literal["constant", "linear", "cosine"]


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    """Batch sizes, run length, evaluation cadence and the seed."""

    micro_batch_size: int = option(
        None, "Samples per micro-batch per data-parallel rank.", range=SIZE)
    global_batch_size: int | None = option(
        None, "Samples per optimizer step; default micro batch size x DP size.", range=BATCH)
    rampup_batch_size: tuple[int, int, int] | None = option(
        None, "START INCR SAMPLES: grow the global batch from START by INCR over SAMPLES.",
        nargs=3)
    train_iters: int | None = option(
        None, "Optimizer steps to run (or use --train-samples).", range=ITERATIONS)
    train_samples: int | None = option(
        None, "Samples to train on (or use --train-iters).", range=SAMPLES)
    eval_interval: int = option(1000, "Evaluate every this many iterations.", range=ITERATIONS)
    eval_iters: int = option(100, "Global batches per evaluation.", range=Range(0, 2**20))
    seed: int = option(1234, "Seed for initialisation, data and dropout.", range=SEED)
    skip_train: bool = option(
        False, "Evaluate the --load checkpoint on the validation and test splits and exit "
        "without training.")


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """AdamW hyper-parameters and gradient clipping."""

    lr: float | None = option(None, "Peak learning rate.", range=LEARNING_RATE)
    min_lr: float = option(0.0, "Learning rate at the end of decay.", range=NON_NEGATIVE)
    weight_decay: float = option(
        0.01, "Decoupled weight decay (biases and norms get none).", range=NON_NEGATIVE)
    clip_grad: float = option(
        1.0, "Clip the global gradient norm to this; 0 disables.", range=NON_NEGATIVE)
    adam_beta1: float = option(0.9, "Adam beta1.", range=PROBABILITY)
    adam_beta2: float = option(0.999, "Adam beta2.", range=PROBABILITY)
    adam_eps: float = option(1e-8, "Adam epsilon.", range=POSITIVE)


@dataclass(frozen=True, kw_only=True)
class LRScheduleConfig:
    """Warmup then decay, measured in samples (iteration flags are converted)."""

    lr_decay_style: LRDecayStyle = option("linear", "constant, linear or cosine.")
    lr_warmup_iters: int = option(0, "Warmup length in iterations.", range=Range(0, 2**32))
    lr_warmup_samples: int = option(0, "Warmup length in samples.", range=Range(0, 2**40))
    lr_warmup_fraction: float | None = option(
        None, "Warmup as a fraction of the decay length.", range=FRACTION)
    lr_decay_iters: int | None = option(
        None, "Decay length in iterations; default the run.", range=ITERATIONS)
    lr_decay_samples: int | None = option(
        None, "Decay length in samples; default the run.", range=SAMPLES)
    override_opt_param_scheduler: bool = option(
        False, "On resume, take the schedule from these flags when they differ from the "
        "checkpoint's (the run length, warmup, decay or learning rates changed).")
    use_checkpoint_opt_param_scheduler: bool = option(
        False, "On resume, keep the checkpoint's schedule when these flags differ from it.")


@dataclass(frozen=True, kw_only=True)
class PrecisionConfig:
    """fp32 (default), bf16 with fp32 master weights, or fp16 with loss scaling."""

    bf16: bool = option(False, "bf16 parameters and activations, fp32 master weights and grads.")
    fp16: bool = option(False, "fp16 parameters and activations with dynamic loss scaling.")
    loss_scale: float | None = option(
        None, "Static fp16 loss scale; default dynamic.", range=LOSS_SCALE)
    initial_loss_scale: float = option(2.0**32, "Starting dynamic loss scale.",
                                       range=LOSS_SCALE)
    min_loss_scale: float = option(1.0, "Smallest dynamic loss scale.", range=POSITIVE)
    loss_scale_window: int = option(
        1000, "Clean steps before the dynamic scale doubles.", range=AT_LEAST_ONE)
    hysteresis: int = option(
        2, "Overflows tolerated before the dynamic scale halves.", range=AT_LEAST_ONE)

    @property
    def params_dtype_name(self) -> str:
        return "bfloat16" if self.bf16 else "float16" if self.fp16 else "float32"
