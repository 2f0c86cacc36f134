"""Assemble a ``Trainer`` from a validated config and the parallel state.

This is the one place that knows how the parts fit: the model's layer specs partitioned into
this rank's pipeline stage, flat buffers and optimizer, gradient reductions between backward
and the step, batch and LR schedules, data, and the logging rank's TensorBoard writer.
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
from megatron3d.model.gpt import gpt_layer_specs, layer_param_counts, lm_loss
from megatron3d.mpu import comm
from megatron3d.mpu.meta import get_meta
from megatron3d.mpu.random import RNGStreams
from megatron3d.mpu.replicas import check_tp_replicas
from megatron3d.mpu.state import AxisGroup, ParallelState
from megatron3d.optim.flat_buffers import FlatBuffers
from megatron3d.optim.lr_schedule import LRSchedule
from megatron3d.optim.mixed_precision import MixedPrecisionOptimizer
from megatron3d.optim.optimizer import format_param_groups
from megatron3d.pipeline.engine import PipelineEngine
from megatron3d.pipeline.partition import format_partition_table, partition_layers
from megatron3d.pipeline.spec import build_stage
from megatron3d.pipeline.tied import TiedWeights
from megatron3d.training.batch_schedule import BatchSchedule
from megatron3d.training.loop import Trainer

logger = get_logger(__name__)

VALID_SAMPLE_OFFSET = 2**48
"""Validation samples of the mock dataset start here: same distribution, disjoint samples."""


def logging_rank(state: ParallelState) -> int:
    """The last rank: it holds the loss (last pipeline stage) and writes logs and TensorBoard."""
    return state.world_size - 1


def build_trainer(cfg: TrainConfig, state: ParallelState, dev: torch.device) -> Trainer:
    ctx = LayerContext(cfg.model, state.tp, cfg.training.seed,
                       getattr(torch, cfg.precision.params_dtype_name), dev,
                       RNGStreams.create(cfg.training.seed, state.tp.rank, dev),
                       sequence_parallel=cfg.parallel.sequence_parallel)
    engine = build_engine(cfg, state, ctx)
    params = list(engine.stage.parameters())
    tied = TiedWeights(params, state.embedding)
    tied.broadcast_from_first_stage()
    check_replicas = functools.partial(check_tp_replicas, params, state.tp)
    check_replicas()
    optimizer = build_optimizer(cfg, state, engine.stage)
    schedule = BatchSchedule.from_config(cfg.training, state.dp.size)
    total_iters, train_samples = _run_length(cfg, schedule)
    lr_schedule = LRSchedule.from_config(cfg.optimizer, cfg.lr_schedule, train_samples,
                                         schedule.global_batch_size,
                                         iteration_based=cfg.training.train_iters is not None)
    dataset = MockGPTDataset(cfg.model.vocab_size, cfg.model.seq_length, cfg.training.seed)
    batches = functools.partial(_batches, dataset, cfg.training.micro_batch_size, state, dev)
    logger.info("model: %s parameters on this rank", f"{sum(p.numel() for p in params):,}")
    return Trainer(
        cfg=cfg, engine=engine, optimizer=optimizer, train_batches=batches,
        valid_batches=lambda i: batches(VALID_SAMPLE_OFFSET + i * schedule.global_batch_size,
                                        schedule.global_batch_size),
        batch_schedule=schedule, lr_schedule=lr_schedule, total_iters=total_iters,
        world_size=state.world_size, padded_vocab_size=ctx.padded_vocab_size, device=dev,
        writer=TensorBoardWriter(cfg.logging.tensorboard_dir,
                                 enabled=state.world_rank == logging_rank(state)),
        check_replicas=check_replicas,
        sync_grads=functools.partial(
            _sync_grads, [p.main_grad for p in params if get_meta(p).sequence_parallel],
            state.tp, tied))


def build_engine(cfg: TrainConfig, state: ParallelState, ctx: LayerContext) -> PipelineEngine:
    """This rank's stage of the partitioned layer specs, and the engine that runs it."""
    specs = gpt_layer_specs(ctx)
    names, counts = [s.type_name for s in specs], layer_param_counts(ctx)
    bounds = partition_layers(names, counts, state.pp.size, cfg.parallel.pp_partition_method)
    logger.info(format_partition_table(bounds, names, counts))
    stage = build_stage(specs, bounds[state.pp.rank], bounds[state.pp.rank + 1])
    tp = state.tp.size if cfg.parallel.sequence_parallel else 1
    shape = (cfg.model.seq_length // tp, cfg.training.micro_batch_size, cfg.model.hidden_size)
    return PipelineEngine(
        stage, state.pp, lambda out, batch: lm_loss(out, batch.labels, batch.loss_mask, ctx),
        activation_shape=shape, dtype=ctx.params_dtype, device=ctx.device,
        schedule=cfg.parallel.pipeline_schedule)


def build_optimizer(cfg: TrainConfig, state: ParallelState,
                    model: nn.Module) -> MixedPrecisionOptimizer:
    """Flat buffers over the stage's parameters, and the optimizer over them."""
    def counted(p: nn.Parameter) -> bool:
        """Count each logical parameter once in the grad norm: TP replicas on TP rank 0,
        tied copies on the first pipeline stage."""
        meta = get_meta(p)
        if meta.tied_key is not None and not state.is_first_stage:
            return False
        return meta.tp_split_dim is not None or state.tp.rank == 0

    buffers = FlatBuffers(list(model.parameters()), counted=counted)
    optimizer = MixedPrecisionOptimizer(buffers, cfg.optimizer, cfg.precision,
                                        norm_axes=[state.mp])
    logger.info(format_param_groups(optimizer.groups, cfg.optimizer.weight_decay))
    return optimizer


def _sync_grads(sequence_parallel_grads: list[torch.Tensor], tp: AxisGroup,
                tied: TiedWeights) -> None:
    """Reductions between backward and the optimizer step."""
    comm.all_reduce_coalesced(sequence_parallel_grads, tp)
    tied.all_reduce_grads()


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
