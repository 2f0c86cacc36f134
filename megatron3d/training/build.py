"""Assemble a ``Trainer`` from a validated config and the parallel state.

This is the one place that knows how the parts fit: the model's layer specs partitioned into
this rank's pipeline stage, flat buffers and optimizer, gradient reductions between backward
and the step, batch and LR schedules, data, and the logging rank's TensorBoard writer.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import torch
from torch import nn

from megatron3d.accounting import memory
from megatron3d.accounting.model_size import ModelSize, format_padded_vocab, model_size
from megatron3d.checkpoint import loading
from megatron3d.checkpoint import saving as checkpoint
from megatron3d.checkpoint.reader import find
from megatron3d.config import TrainConfig
from megatron3d.data.sampler import MicroBatch, TokenDataset, micro_batches
from megatron3d.log import TensorBoardWriter, every_rank_logger, get_logger
from megatron3d.model.context import LayerContext
from megatron3d.model.gpt import gpt_layer_specs, layer_param_counts, lm_loss
from megatron3d.mpu.meta import get_meta
from megatron3d.mpu.random import RNGStreams
from megatron3d.mpu.replicas import check_tp_replicas
from megatron3d.mpu.state import ParallelState
from megatron3d.optim.batch_schedule import BatchSchedule
from megatron3d.optim.lr_schedule import LRSchedule
from megatron3d.optim.mixed_precision import MixedPrecisionOptimizer
from megatron3d.optim.optimizer import format_param_groups
from megatron3d.pipeline.engine import PipelineEngine
from megatron3d.pipeline.partition import format_partition_table, partition_layers
from megatron3d.pipeline.spec import VirtualStages, build_chunks
from megatron3d.pipeline.tied import TiedWeights
from megatron3d.training.data_setup import build_run_data
from megatron3d.training.exit_watch import ExitWatch
from megatron3d.training.grad_sync import GradSync
from megatron3d.training.loop import Progress, Trainer
from megatron3d.training.preflight import check_same_config
from megatron3d.zero.factory import DataParallel, build_data_parallel

logger = get_logger(__name__)

def logging_rank(state: ParallelState) -> int:
    """The last rank: it holds the loss (last pipeline stage) and writes logs and TensorBoard."""
    return state.world_size - 1


def build_trainer(cfg: TrainConfig, state: ParallelState, dev: torch.device,
                  started: float | None = None) -> Trainer:
    """``started``: ``time.monotonic()`` at process start, for --exit-duration-in-mins."""
    check_same_config(cfg, state.world, dev)  # before anything could hang on a mismatch
    schedule = BatchSchedule.from_config(cfg.training, state.dp.size)
    total_iters, train_samples = run_length(cfg, schedule)
    data = build_run_data(cfg, train_samples, valid_samples(cfg, schedule), state.pp, dev)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model,
                                                             vocab_size=data.vocab_size))
    lr_schedule = loading.resume_schedule(cfg, LRSchedule.from_config(
        cfg.optimizer, cfg.lr_schedule, train_samples, schedule.samples_for_iters,
        iteration_based=cfg.training.train_iters is not None))  # before the model: may refuse
    rng = RNGStreams.create(cfg.training.seed, state.tp.rank, state.pp.rank, dev)
    # A checkpoint to load fills every weight: then nothing is drawn and the weights start at
    # zero, equal on all copies for the tied broadcast and replica checks until it does.
    directory = find(cfg.checkpoint.load) if cfg.checkpoint.load else None
    ctx = LayerContext(cfg.model, state.tp, cfg.training.seed,
                       getattr(torch, cfg.precision.params_dtype_name), dev, rng,
                       sequence_parallel=cfg.parallel.sequence_parallel,
                       draw_weights=directory is None)
    logger.info(format_padded_vocab(cfg.model.vocab_size, ctx.padded_vocab_size))
    size = model_size(ctx)
    engine = build_engine(cfg, state, ctx, size)
    params = list(engine.stage.parameters())
    tied = TiedWeights(params, state.embedding)
    tied.broadcast_from_first_stage()
    data_parallel = build_data_parallel(params, list(engine.stage.layers), state.dp,
                                        cfg.parallel, functools.partial(_counted, state), dev,
                                        tuple(len(chunk.layers) for chunk in engine.chunks))
    if data_parallel.observer is not None:
        engine.observers.append(data_parallel.observer)

    def check_replicas() -> None:
        check_tp_replicas(data_parallel.values_of(params), state.tp)

    check_replicas()
    optimizer = build_optimizer(cfg, state, data_parallel, params)
    grad_sync = GradSync(params, data_parallel, tied, state)
    progress, series = _resume(cfg, state, params, optimizer, rng, directory)
    if cfg.checkpoint.load:  # copies must agree after loading as they did at start
        check_replicas()
        tied.check_identical(data_parallel.values_of(tied.params))
    batches = functools.partial(_batches, data.train, data.eod, cfg.training.micro_batch_size,
                                state, dev)
    valid = functools.partial(_batches, data.valid, data.eod, cfg.training.micro_batch_size,
                              state, dev)
    logger.info("model: %s parameters on this rank, %s unique parameters in total (all stages "
                "and TP shards, a tied embedding once)", f"{sum(p.numel() for p in params):,}",
                f"{size.unique:,}")
    test = None if data.test is None else functools.partial(
        _batches, data.test, data.eod, cfg.training.micro_batch_size, state, dev)
    return Trainer(
        cfg=cfg, engine=engine, optimizer=optimizer, train_batches=batches,
        valid_batches=lambda i: valid(i * schedule.global_batch_size,
                                      schedule.global_batch_size),
        test_batches=None if test is None else lambda i: test(i * schedule.global_batch_size,
                                                              schedule.global_batch_size),
        batch_schedule=schedule, lr_schedule=lr_schedule, total_iters=total_iters,
        world_size=state.world_size, padded_vocab_size=ctx.padded_vocab_size, device=dev,
        writer=TensorBoardWriter(cfg.logging.tensorboard_dir,
                                 enabled=state.world_rank == logging_rank(state)),
        check_replicas=check_replicas, grad_sync=grad_sync, dp=state.dp,
        data_parallel=data_parallel,
        save=checkpoint.Saver(cfg, state, params, optimizer, rng, lr_schedule, series)
        if cfg.checkpoint.save else None,
        exit_watch=ExitWatch(cfg.checkpoint, state.world, dev, started), progress=progress)


def build_engine(cfg: TrainConfig, state: ParallelState, ctx: LayerContext,
                 size: ModelSize) -> PipelineEngine:
    """This rank's stage of the partitioned layer specs, and the engine that runs it;
    ``size`` names and counts the layers in the logged stage table."""
    specs = gpt_layer_specs(ctx)
    names, counts = [s.type_name for s in specs], layer_param_counts(ctx)
    p, v = state.pp.size, cfg.parallel.virtual_size(cfg.model.num_layers)
    bounds = partition_layers(names, counts, p, cfg.parallel.pp_partition_method, v)
    logger.info(format_partition_table(bounds, size.labels, size.counts, size.tied, p))
    spans = [(bounds[c * p + state.pp.rank], bounds[c * p + state.pp.rank + 1])
             for c in range(v)]  # chunk c is virtual stage c * p + rank
    chunks = build_chunks(specs, spans)
    stage = chunks[0] if v == 1 else VirtualStages(chunks)
    tp = state.tp.size if cfg.parallel.sequence_parallel else 1
    shape = (cfg.model.seq_length // tp, cfg.training.micro_batch_size, cfg.model.hidden_size)
    return PipelineEngine(
        stage, state.pp, lambda out, batch: lm_loss(out, batch.labels, batch.loss_mask, ctx),
        activation_shape=shape, dtype=ctx.params_dtype, device=ctx.device,
        schedule=cfg.parallel.pipeline_schedule, chunks=v)


def _counted(state: ParallelState, p: nn.Parameter) -> bool:
    """Count each logical parameter once in the grad norm: TP replicas on TP rank 0, tied
    copies on the first pipeline stage."""
    meta = get_meta(p)
    if meta.tied_key is not None and not state.is_first_stage:
        return False
    return meta.tp_split_dim is not None or state.tp.rank == 0


def build_optimizer(cfg: TrainConfig, state: ParallelState, data_parallel: DataParallel,
                    params: list[nn.Parameter]) -> MixedPrecisionOptimizer:
    """The optimizer over this rank's shard (all of the stage without ZeRO). Under ZeRO the
    gradients are spread over DP too; without it, DP ranks hold replicas that must agree."""
    stage = cfg.parallel.zero_stage
    optimizer = MixedPrecisionOptimizer(
        data_parallel.shard, cfg.optimizer, cfg.precision,
        norm_axes=[state.mp, state.dp] if stage else [state.mp],
        gather_params=data_parallel.gather_params, replica_axes=[] if stage else [state.dp],
        count_zeros=cfg.logging.log_num_zeros_in_grad)
    logger.info(format_param_groups(optimizer.groups, cfg.optimizer.weight_decay))
    every_rank_logger().info(memory.report(
        f"memory (ZeRO-{stage}, DP={state.dp.size}):",
        memory.analytic(sum(p.numel() for p in params), params[0].element_size(), stage,
                        state.dp.size, memory.live_numel(data_parallel))))
    return optimizer


def _resume(cfg: TrainConfig, state: ParallelState, params: list[nn.Parameter],
            optimizer: MixedPrecisionOptimizer, rng: RNGStreams,
            directory: Path | None) -> tuple[Progress, str]:
    """Where training starts (the position of the checkpoint in ``directory``, found in
    --load, or zero) and the series of checkpoints this run writes (the loaded one's when
    resuming, else a new one)."""
    if directory is None:
        if cfg.checkpoint.load:
            logger.info("no checkpoint in %s: starting from scratch", cfg.checkpoint.load)
        return Progress(), checkpoint.Progress.new_series()
    loaded = loading.load(directory, cfg, state, params, optimizer, rng,
                             weights_only=cfg.checkpoint.finetune)
    logger.info("loaded %s (iteration %d)", directory, loaded.iteration)
    return Progress(loaded.iteration, loaded.consumed_samples,
                    loaded.consumed_tokens), loaded.series


def valid_samples(cfg: TrainConfig, schedule: BatchSchedule) -> int:
    """Samples one evaluation reads (the same ones at every evaluation)."""
    return cfg.training.eval_iters * schedule.global_batch_size


def run_length(cfg: TrainConfig, schedule: BatchSchedule) -> tuple[int, int]:
    """(iterations, samples) of the whole run from --train-iters or --train-samples."""
    if cfg.training.train_iters is not None:
        return cfg.training.train_iters, schedule.samples_for_iters(cfg.training.train_iters)
    samples = cfg.training.train_samples
    return schedule.iters_for_samples(samples), samples


def _batches(dataset: TokenDataset, eod: int | None, micro_batch_size: int,
             state: ParallelState, dev: torch.device, consumed: int,
             gbs: int) -> list[MicroBatch]:
    return micro_batches(dataset, consumed, gbs, micro_batch_size, state.dp.rank, state.dp.size,
                         dev, eod)
