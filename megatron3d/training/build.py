"""Assemble a ``Trainer`` from a validated config and the parallel state.

This is the one place that knows how the parts fit: model from layer specs, flat buffers and
optimizer, batch and LR schedules, data, and the logging rank's TensorBoard writer.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from megatron3d.config import TrainConfig
from megatron3d.data.mock import MockGPTDataset
from megatron3d.data.sampler import MicroBatch, TokenDataset, micro_batches
from megatron3d.log import TensorBoardWriter, get_logger
from megatron3d.model.context import LayerContext
from megatron3d.model.gpt import build_gpt, lm_loss
from megatron3d.mpu import comm
from megatron3d.mpu.meta import get_meta
from megatron3d.mpu.random import RNGStreams
from megatron3d.mpu.replicas import check_tp_replicas
from megatron3d.mpu.state import ParallelState
from megatron3d.optim.flat_buffers import FlatBuffers
from megatron3d.optim.lr_schedule import LRSchedule
from megatron3d.optim.mixed_precision import MixedPrecisionOptimizer
from megatron3d.optim.optimizer import format_param_groups
from megatron3d.training.batch_schedule import BatchSchedule
from megatron3d.training.loop import Trainer

logger = get_logger(__name__)

VALID_SAMPLE_OFFSET = 2**48
"""Validation samples of the mock dataset start here: same distribution, disjoint samples."""


def logging_rank(state: ParallelState) -> int:
    """The last rank: it holds the loss (last pipeline stage) and writes logs and TensorBoard."""
    return state.world_size - 1


def build_trainer(cfg: TrainConfig, state: ParallelState, dev: torch.device) -> Trainer:
    rng = RNGStreams.create(cfg.training.seed, state.tp.rank, dev)
    dtype = getattr(torch, cfg.precision.params_dtype_name)
    ctx = LayerContext(cfg.model, state.tp, cfg.training.seed, dtype, dev, rng,
                       sequence_parallel=cfg.parallel.sequence_parallel)
    model = build_gpt(ctx)
    params = list(model.parameters())
    check_replicas = functools.partial(check_tp_replicas, params, state.tp)
    check_replicas()
    optimizer = build_optimizer(cfg, state, model)
    sequence_parallel_grads = [p.main_grad for p in params if get_meta(p).sequence_parallel]
    schedule = BatchSchedule.from_config(cfg.training, state.dp.size)
    total_iters, train_samples = _run_length(cfg, schedule)
    lr_schedule = LRSchedule.from_config(cfg.optimizer, cfg.lr_schedule, train_samples,
                                         schedule.global_batch_size,
                                         iteration_based=cfg.training.train_iters is not None)
    dataset = MockGPTDataset(cfg.model.vocab_size, cfg.model.seq_length, cfg.training.seed)
    batches = functools.partial(_batches, dataset, cfg.training.micro_batch_size, state, dev)
    logger.info("model: %s parameters on this rank", f"{_count(model):,}")
    return Trainer(
        cfg=cfg, model=model, optimizer=optimizer,
        loss_fn=lambda logits, batch: lm_loss(logits, batch.labels, batch.loss_mask, ctx),
        train_batches=batches,
        valid_batches=lambda i: batches(VALID_SAMPLE_OFFSET + i * schedule.global_batch_size,
                                        schedule.global_batch_size),
        batch_schedule=schedule, lr_schedule=lr_schedule, total_iters=total_iters,
        world_size=state.world_size, padded_vocab_size=ctx.padded_vocab_size, device=dev,
        writer=TensorBoardWriter(cfg.logging.tensorboard_dir,
                                 enabled=state.world_rank == logging_rank(state)),
        check_replicas=check_replicas,
        sync_grads=functools.partial(comm.all_reduce_coalesced, sequence_parallel_grads,
                                     state.tp))


def build_optimizer(cfg: TrainConfig, state: ParallelState,
                    model: nn.Module) -> MixedPrecisionOptimizer:
    """Flat buffers over the model's parameters, and the optimizer over them."""
    def counted(p: nn.Parameter) -> bool:
        # TP-replicated parameters are counted in the grad norm on TP rank 0 only.
        return get_meta(p).tp_split_dim is not None or state.tp.rank == 0

    buffers = FlatBuffers(list(model.parameters()), counted=counted)
    optimizer = MixedPrecisionOptimizer(buffers, cfg.optimizer, cfg.precision,
                                        norm_axes=[state.mp])
    logger.info(format_param_groups(optimizer.groups, cfg.optimizer.weight_decay))
    return optimizer


def _run_length(cfg: TrainConfig, schedule: BatchSchedule) -> tuple[int, int]:
    """(iterations, samples) of the whole run from --train-iters or --train-samples."""
    if cfg.training.train_iters is not None:
        return cfg.training.train_iters, schedule.samples_for_iters(cfg.training.train_iters)
    samples = cfg.training.train_samples
    return schedule.iters_for_samples(samples), samples


def _batches(dataset: TokenDataset, micro_batch_size: int, state: ParallelState,
             dev: torch.device, consumed: int, gbs: int) -> list[MicroBatch]:
    return micro_batches(dataset, consumed, gbs, micro_batch_size, state.dp.rank, state.dp.size,
                         dev)


def _count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
