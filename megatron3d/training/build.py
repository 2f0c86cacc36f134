"""Assemble a ``Trainer`` from a validated config and the parallel state.

This is the one place that knows how the parts fit: the model's layer specs partitioned into
this rank's pipeline stage, flat buffers and optimizer, gradient reductions between backward
and the step, batch and LR schedules, data, and the logging rank's TensorBoard writer.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn

from megatron3d.accounting import memory
from megatron3d.accounting.fit import format_phases, layout_memory
from megatron3d.accounting.model_size import ModelSize, format_padded_vocab, model_size
from megatron3d.checkpoint import loading
from megatron3d.checkpoint import saving as checkpoint
from megatron3d.checkpoint.local.setup import LocalCheckpoints, open_local
from megatron3d.checkpoint.progress import Progress, new_series
from megatron3d.checkpoint.reader import find
from megatron3d.config import TrainConfig
from megatron3d.cp.batch import shard_micro_batch
from megatron3d.data.documents import Documents
from megatron3d.data.sampler import MicroBatch, TokenDataset, micro_batches
from megatron3d.data.vocab_padding import check_vocab_padding
from megatron3d.log import every_rank_logger, get_logger
from megatron3d.model import compiled
from megatron3d.model.context import LayerContext
from megatron3d.model.gpt import gpt_layer_specs, layer_param_counts, lm_loss, split_layers
from megatron3d.mpu.random import RNGStreams
from megatron3d.mpu.replicas import check_tp_replicas, counted_once
from megatron3d.mpu.state import AxisGroup, ParallelState
from megatron3d.optim.batch_schedule import BatchSchedule
from megatron3d.optim.lr_schedule import LRSchedule
from megatron3d.optim.mixed_precision import MixedPrecisionOptimizer
from megatron3d.optim.optimizer import format_param_groups
from megatron3d.pipeline.engine import PipelineEngine, ProgramObserver
from megatron3d.pipeline.partition import format_partition_table
from megatron3d.pipeline.spec import VirtualStages, build_chunks
from megatron3d.pipeline.tied import TiedWeights
from megatron3d.training.data_setup import Datasets, build_run_data
from megatron3d.training.divergence import SkipWatch
from megatron3d.training.exit_watch import ExitWatch
from megatron3d.training.grad_sync import GradSync
from megatron3d.training.loop import Hooks, ModelParts, RunData, Saver, Trainer
from megatron3d.training.preflight import check_same_config
from megatron3d.training.reporting import Reporter
from megatron3d.training.rerun import BadStepRerun
from megatron3d.training.straggler import StragglerWatch, stage_peers
from megatron3d.training.tensorboard import TensorBoardWriter
from megatron3d.zero.checks import node_warnings
from megatron3d.zero.factory import DataParallel, build_data_parallel

logger = get_logger(__name__)
T = TypeVar("T")


def logging_rank(state: ParallelState) -> int:
    """The last rank: it holds the loss (last pipeline stage) and writes logs and TensorBoard."""
    return state.world_size - 1


@dataclass(frozen=True)
class Overrides:
    """What a caller puts in place of, or around, the parts ``build_trainer`` makes: the entry
    point's hang watchdog, the instruments of tests and benchmarks. Each ``Callable`` field
    receives the part built and returns the one the trainer uses."""

    hooks: Hooks = field(default_factory=Hooks)
    observers: tuple[ProgramObserver, ...] = ()  # told every pipeline instruction the engine runs
    progress: Progress | None = None  # where to start instead of the loaded position
    engine: Callable[[PipelineEngine], PipelineEngine] | None = None
    grad_sync: Callable[[GradSync], GradSync] | None = None
    check_replicas: Callable[[Callable[[], None]], Callable[[], None]] | None = None
    save: Callable[[Saver | None], Saver | None] | None = None
    local: Callable[[LocalCheckpoints], LocalCheckpoints] | None = None  # under the flags


def build_trainer(cfg: TrainConfig, state: ParallelState, dev: torch.device,
                  started: float | None = None,
                  overrides: Overrides | None = None) -> Trainer:
    """``started``: ``time.monotonic()`` at process start, for --exit-duration-in-mins."""
    given = overrides or Overrides()
    check_same_config(cfg, state.world, dev)  # before anything could hang on a mismatch
    schedule = BatchSchedule.from_config(cfg.training, state.dp.size)  # dp reads samples
    total_iters, train_samples = run_length(cfg, schedule)
    heartbeat = given.hooks.heartbeat  # the slow start-up phases get their own allowances
    with heartbeat.allowance("dataset index building"):
        data = build_run_data(cfg, train_samples, valid_samples(cfg, schedule), state.pp, dev)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model,
                                                             vocab_size=data.vocab_size))
    # the tokenizer is read now: its vocabulary must fit --pad-vocab-size-to
    check_vocab_padding(cfg.model.pad_vocab_size_to, state.tp.size, data.vocab_size)
    lr_schedule = loading.resume_schedule(cfg, LRSchedule.from_config(
        cfg.optimizer, cfg.lr_schedule, train_samples, schedule.samples_for_iters,
        iteration_based=cfg.training.train_iters is not None))  # before the model: may refuse
    rng = RNGStreams.create(cfg.training.seed, state.tp.rank, state.pp.rank, dev,
                            cp_rank=state.cp.rank)
    # A checkpoint to load fills every weight: then nothing is drawn and the weights start at
    # zero, equal on all copies for the replica checks until it does. The stage is built on
    # the meta device; the ZeRO stage allocates its storage and draws this rank's share.
    directory = find(cfg.checkpoint.load) if cfg.checkpoint.load else None
    local = open_local(cfg, state)  # a newer local state replaces --load's (every rank)
    if local is not None:
        local = _wrapped(given.local, local)
        directory = local.restore(directory)
    if cfg.model.compile:  # before the first forward compiles anything
        compiled.configure(compiled.cache_dir(cfg.checkpoint.compile_cache_dir,
                                              cfg.checkpoint.save), dev)
    ctx = LayerContext(cfg.model, state.tp, cfg.training.seed,
                       getattr(torch, cfg.precision.params_dtype_name), dev, rng,
                       sequence_parallel=cfg.parallel.sequence_parallel,
                       draw_weights=directory is None, defer_init=True, cp=state.cp,
                       cp_comm_type=cfg.parallel.cp_comm_type)
    logger.info(format_padded_vocab(cfg.model.vocab_size, ctx.padded_vocab_size))
    for warning in node_warnings(cfg.parallel, state.ranks_per_node):
        logger.warning(warning)
    size = model_size(ctx)
    engine = _wrapped(given.engine, build_engine(cfg, state, ctx, size))
    params = list(engine.stage.parameters())
    tied = TiedWeights(params, state.embedding)
    # CP ranks hold replicas of the weights too: ZeRO shards and averages over dp x cp
    data_parallel = build_data_parallel(params, list(engine.stage.layers), state.dp_cp,
                                        cfg.parallel, functools.partial(counted_once, state),
                                        dev, tuple(len(chunk.layers) for chunk in engine.chunks),
                                        (state.dp_intra, state.dp_inter))
    engine.observers.extend(o for o in (data_parallel.observer, *given.observers)
                            if o is not None)

    def check_replicas() -> None:
        check_tp_replicas(data_parallel.values_of(params), state.tp)

    def check_copies() -> None:  # drawn alike by construction, loaded alike by design
        check_replicas()
        tied.check_identical(data_parallel.values_of(tied.params))

    check_copies()
    optimizer = build_optimizer(cfg, state, data_parallel, params)
    with heartbeat.allowance("checkpoint load"):
        progress, series = _resume(cfg, state, params, optimizer, rng, directory)
    if directory is not None:  # copies must agree after loading as they did at start
        check_copies()
    logger.info("model: %s parameters on this rank, %s unique parameters in total (all stages "
                "and TP shards, a tied embedding once)", f"{sum(p.numel() for p in params):,}",
                f"{size.unique:,}")
    model = ModelParts(engine, optimizer, data_parallel,
                       _wrapped(given.grad_sync, GradSync(params, data_parallel, tied, state)),
                       _wrapped(given.check_replicas, check_replicas), state.dp_cp)
    saver = (checkpoint.Saver(cfg, state, params, optimizer, rng, lr_schedule, series)
             if cfg.checkpoint.save else None)
    local_save = (None if local is None else local.saver(
        cfg, state, params, optimizer, rng, lr_schedule, saver.series if saver else series))
    writer = TensorBoardWriter(cfg.logging.tensorboard_dir,
                               enabled=state.world_rank == logging_rank(state))
    rerun = (BadStepRerun(cfg.resilience, engine, optimizer, model.grad_sync, state.dp_cp,
                          state.world, rng, writer,
                          logs=state.world_rank == logging_rank(state), fp16=cfg.precision.fp16,
                          seq_length=cfg.model.seq_length, save=cfg.checkpoint.save)
             if cfg.resilience.rerun_on_bad_step else None)
    return Trainer(
        cfg=cfg, model=model, data=_run_data(data, cfg, state, dev, schedule),
        batch_schedule=schedule, lr_schedule=lr_schedule, total_iters=total_iters,
        reporter=Reporter(cfg, writer, dev, state.world_size, ctx.padded_vocab_size,
                          total_iters, optimizer.params_norm),
        save=_wrapped(given.save, saver),
        exit_watch=ExitWatch(cfg.checkpoint, state.world, dev, started),
        progress=given.progress or progress,
        skips=SkipWatch(cfg.resilience.max_skipped_iters_in_a_row, state.world, dev),
        stragglers=StragglerWatch(cfg.resilience.straggler_interval,
                                  cfg.resilience.straggler_threshold, state.world,
                                  stage_peers(state.world_size, state.pp.size), dev, writer),
        hooks=given.hooks, local_save=local_save, rerun=rerun)


def _wrapped(wrap: Callable[[T], T] | None, part: T) -> T:
    return part if wrap is None else wrap(part)


def _run_data(data: Datasets, cfg: TrainConfig, state: ParallelState, dev: torch.device,
              schedule: BatchSchedule) -> RunData:
    """Each split's micro-batches for this rank, by position: training by consumed samples
    and batch size, evaluation by its iteration (the same batches at every evaluation)."""
    mbs, gbs = cfg.training.micro_batch_size, schedule.global_batch_size
    documents = Documents.of(cfg.data, data.eod)

    def reader(dataset: TokenDataset) -> Callable[[int, int], list[MicroBatch]]:
        return lambda consumed, size: micro_batches(dataset, consumed, size, mbs, state.dp.rank,
                                                    state.dp.size, dev, documents)

    def evaluation(dataset: TokenDataset) -> Callable[[int], list[MicroBatch]]:
        read = reader(dataset)
        return lambda i: read(i * gbs, gbs)

    # The CP ranks of a DP rank read the same micro-batches; each keeps its shard of them.
    test = None if data.test is None else on_cp_rank(evaluation(data.test), state.cp)
    return RunData(train=on_cp_rank(reader(data.train), state.cp),
                   valid=on_cp_rank(evaluation(data.valid), state.cp), test=test)


def on_cp_rank(read: Callable[..., list[MicroBatch]],
               cp: AxisGroup) -> Callable[..., list[MicroBatch]]:
    """``read``'s micro-batches cut to this context-parallel rank's tokens (``cp/batch.py``);
    ``read`` itself without CP."""
    if cp.size == 1:
        return read
    return lambda *position: [shard_micro_batch(mb, cp) for mb in read(*position)]


def build_engine(cfg: TrainConfig, state: ParallelState, ctx: LayerContext,
                 size: ModelSize) -> PipelineEngine:
    """This rank's stage of the partitioned layer specs, and the engine that runs it;
    ``size`` names and counts the layers in the logged stage table."""
    specs = gpt_layer_specs(ctx)
    names, counts = [s.type_name for s in specs], layer_param_counts(ctx)
    p, v = state.pp.size, cfg.parallel.virtual_size(cfg.model.num_layers)
    bounds = split_layers(names, counts, p, cfg.parallel.pp_partition_method, v,
                          cfg.parallel.num_layers_per_virtual_pipeline_stage)
    logger.info(format_partition_table(bounds, size.labels, size.counts, size.tied, p))
    spans = [(bounds[c * p + state.pp.rank], bounds[c * p + state.pp.rank + 1])
             for c in range(v)]  # chunk c is virtual stage c * p + rank
    chunks = build_chunks(specs, spans)
    stage = chunks[0] if v == 1 else VirtualStages(chunks)
    tp = state.tp.size if cfg.parallel.sequence_parallel else 1  # CP's shard, split by SP
    shape = (cfg.model.seq_length // (state.cp.size * tp), cfg.training.micro_batch_size,
             cfg.model.hidden_size)
    return PipelineEngine(
        stage, state.pp, lambda out, batch: lm_loss(out, batch.labels, batch.loss_mask, ctx),
        activation_shape=shape, dtype=ctx.params_dtype, device=ctx.device,
        schedule=cfg.parallel.pipeline_schedule, chunks=v)


def build_optimizer(cfg: TrainConfig, state: ParallelState, data_parallel: DataParallel,
                    params: list[nn.Parameter]) -> MixedPrecisionOptimizer:
    """The optimizer over this rank's shard (all of the stage without ZeRO). Under ZeRO the
    gradients are spread over DP too; ranks holding replicas of the shard (DP without ZeRO,
    the other nodes under hybrid ZeRO-3) must agree (DP here is dp x cp: context-parallel
    ranks hold replicas of the weights as well)."""
    stage = cfg.parallel.zero_stage
    spread, copies = data_parallel.norm_axis, data_parallel.replica_axis
    optimizer = MixedPrecisionOptimizer(
        data_parallel.shard, cfg.optimizer, cfg.precision,
        norm_axes=[state.mp] + ([spread] if spread is not None else []),
        gather_params=data_parallel.gather_params,
        replica_axes=[copies] if copies is not None else [],
        count_zeros=cfg.logging.log_num_zeros_in_grad)
    logger.info(format_param_groups(optimizer.groups, cfg.optimizer.weight_decay))
    replicas = "" if state.cp.size == 1 else f" x CP={state.cp.size}"
    every_rank_logger().info(memory.report(
        f"memory (ZeRO-{stage}, DP={state.dp.size}{replicas}):",
        memory.expected(params, stage, data_parallel)))
    predicted = layout_memory(cfg, state.world_size, data_parallel.shard.grads.device.type)
    every_rank_logger().info(format_phases(predicted[state.pp.rank], state.pp.rank,
                                           state.cp.size, cfg.parallel.cp_comm_type))
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
        return Progress(), new_series()
    progress, series = loading.load(directory, cfg, state, params, optimizer, rng,
                                    weights_only=cfg.checkpoint.finetune)
    logger.info("loaded %s (iteration %d)", directory, progress.iteration)
    return progress, series


def valid_samples(cfg: TrainConfig, schedule: BatchSchedule) -> int:
    """Samples one evaluation reads (the same ones at every evaluation)."""
    return cfg.training.eval_iters * schedule.global_batch_size


def run_length(cfg: TrainConfig, schedule: BatchSchedule) -> tuple[int, int]:
    """(iterations, samples) of the whole run from --train-iters or --train-samples."""
    if cfg.training.train_iters is not None:
        return cfg.training.train_iters, schedule.samples_for_iters(cfg.training.train_iters)
    samples = cfg.training.train_samples
    return schedule.iters_for_samples(samples), samples
