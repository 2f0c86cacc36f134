"""The training loop: steps, the Megatron log line, TensorBoard and periodic evaluation.

Everything per step stays on the device; the loop syncs with the device only at log and
evaluation boundaries. The data position, batch size and learning rate are pure functions of
``consumed_samples``, so a run is fully described by its ``Progress``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch

from megatron3d import device as devices
from megatron3d.config import TrainConfig
from megatron3d.data.sampler import MicroBatch
from megatron3d.log import (
    IterationStats,
    TensorBoardWriter,
    every_rank_logger,
    format_iteration_line,
    get_logger,
)
from megatron3d.mpu.state import AxisGroup
from megatron3d.optim.lr_schedule import LRSchedule
from megatron3d.optim.mixed_precision import MixedPrecisionOptimizer
from megatron3d.pipeline.engine import PipelineEngine
from megatron3d.training import memory
from megatron3d.training import metrics as m
from megatron3d.training.batch_schedule import BatchSchedule
from megatron3d.training.evaluate import evaluate, format_eval_line
from megatron3d.training.exit_watch import ExitWatch
from megatron3d.training.flops import FlopsCount, flops_per_iteration, throughput
from megatron3d.training.grad_sync import GradSync
from megatron3d.training.step import StepResult, check_grad_norm, train_step
from megatron3d.zero.factory import DataParallel

logger = get_logger(__name__)


@dataclass
class Progress:
    """Where the run is; everything else (batch size, LR, data) follows from it."""

    iteration: int = 0
    consumed_samples: int = 0
    consumed_tokens: int = 0


class Heartbeat(Protocol):
    """Told when a step finishes and when slower work runs (the hang watchdog listens)."""

    def starting(self, iteration: int) -> None: ...
    def beat(self, iteration: int) -> None: ...
    def allowance(self, phase: str) -> contextlib.AbstractContextManager: ...


class _NoHeartbeat:
    def starting(self, iteration: int) -> None:
        pass

    def beat(self, iteration: int) -> None:
        pass

    @contextlib.contextmanager
    def allowance(self, phase: str) -> Iterator[None]:
        yield


@dataclass
class _Interval:
    """Host-side bookkeeping of the current log interval."""

    start_time: float = field(default_factory=time.perf_counter)
    samples: int = 0
    flops_hardware: int = 0
    flops_model: int = 0


@dataclass
class Trainer:
    """Runs ``total_iters`` steps; built by ``training.build``."""

    cfg: TrainConfig
    engine: PipelineEngine
    optimizer: MixedPrecisionOptimizer
    train_batches: Callable[[int, int], list[MicroBatch]]  # (consumed, gbs) -> micro-batches
    valid_batches: Callable[[int], list[MicroBatch]]  # eval iteration -> micro-batches
    batch_schedule: BatchSchedule
    lr_schedule: LRSchedule
    total_iters: int
    world_size: int
    padded_vocab_size: int
    device: torch.device
    writer: TensorBoardWriter
    check_replicas: Callable[[], None]  # raises if TP-replicated parameters drifted
    grad_sync: GradSync  # reductions between backward and the optimizer step
    dp: AxisGroup
    data_parallel: DataParallel  # buffers and shards of this rank's ZeRO stage
    save: Callable[[Progress], None] | None  # writes a checkpoint (None without --save)
    exit_watch: ExitWatch
    progress: Progress = field(default_factory=Progress)
    heartbeat: Heartbeat = field(default_factory=_NoHeartbeat)
    on_step: Callable[[int, StepResult], None] | None = None  # test and benchmark hook

    def run(self) -> Progress:
        """Train to ``total_iters`` (or until an exit condition); save at the end."""
        self.engine.stage.train()
        metrics = m.IntervalMetrics(self.device)
        interval = _Interval()
        self.heartbeat.starting(self.progress.iteration)
        with self.exit_watch:
            while self.progress.iteration < self.total_iters:
                result, lr, gbs = self._step()
                self.heartbeat.beat(self.progress.iteration)
                metrics.add_step(result.loss, result.stats.grad_norm, result.stats.num_zeros,
                                 result.stats.skipped, result.stats.loss_scale,
                                 nan_grad=result.stats.nan)
                self._account(interval, gbs)
                if self._after_step(result, metrics, interval, lr, gbs):
                    interval = _Interval()
                if self.exit_watch.should_stop(self.progress.iteration):
                    logger.info("stopping at iteration %d (signal, --exit-interval or "
                                "--exit-duration-in-mins)", self.progress.iteration)
                    break
            # Still under the signal handlers: the launcher forwards the preemption SIGTERM a
            # moment after the job's own, and it must not kill the final save half-way.
            self._save()
        self.writer.flush()
        return self.progress

    def _after_step(self, result: StepResult, metrics: m.IntervalMetrics, interval: _Interval,
                    lr: float, gbs: int) -> bool:
        """Hooks, logging, evaluation, checks and saving; True if a log line closed the
        interval."""
        it = self.progress.iteration
        if self.on_step is not None:
            self.on_step(it, result)
        if it == 1 and self.cfg.logging.memory_report:
            self._memory_report()
        logged = it % self.cfg.logging.log_interval == 0
        if logged:
            self._log(metrics.collect(), interval, lr, gbs)
        if it % self.cfg.training.eval_interval == 0 and self.cfg.training.eval_iters > 0:
            with self.heartbeat.allowance("evaluation"):
                self._evaluate()
        replicas_every = self.cfg.parallel.check_replicas_interval
        if replicas_every and it % replicas_every == 0:
            self.check_replicas()
        save_every = self.cfg.checkpoint.save_interval
        if save_every and it % save_every == 0:
            self._save()
        return logged

    def _save(self) -> None:
        if self.save is not None:
            with self.heartbeat.allowance("checkpoint save"):
                self.save(self.progress)

    def _step(self) -> tuple[StepResult, float, int]:
        consumed = self.progress.consumed_samples
        gbs = self.batch_schedule.global_batch_size_at(consumed)
        lr = self.lr_schedule.lr_at(consumed)
        result = train_step(self.engine, self.optimizer, self.train_batches(consumed, gbs), lr,
                            self.grad_sync, self.dp)
        self.progress.iteration += 1
        if self.cfg.resilience.check_for_nan_in_loss_and_grad:
            check_grad_norm(result.stats, self.progress.iteration)
        self.progress.consumed_samples += gbs
        self.progress.consumed_tokens += gbs * self.cfg.model.seq_length
        return result, lr, gbs

    def _account(self, interval: _Interval, gbs: int) -> None:
        flops = flops_per_iteration(self.cfg.model, gbs, self.padded_vocab_size)
        interval.samples += gbs
        interval.flops_hardware += flops.hardware
        interval.flops_model += flops.model

    def _log(self, values: dict[str, float], interval: _Interval, lr: float, gbs: int) -> None:
        devices.synchronize(self.device)
        steps = int(values[m.STEPS])
        seconds = time.perf_counter() - interval.start_time
        per_iter = seconds / steps
        rate = throughput(FlopsCount(interval.flops_hardware // steps,
                                     interval.flops_model // steps),
                          per_iter, self.world_size, self._peak_tflops())
        stats = IterationStats(
            iteration=self.progress.iteration, train_iters=self.total_iters,
            consumed_samples=self.progress.consumed_samples,
            consumed_tokens=self.progress.consumed_tokens, elapsed_s=per_iter,
            learning_rate=lr, global_batch_size=gbs, lm_loss=values.get(m.LM_LOSS),
            loss_scale=values.get(m.LOSS_SCALE, 1.0), grad_norm=values.get(m.GRAD_NORM),
            num_zeros=values.get(m.NUM_ZEROS), skipped_iterations=int(values[m.SKIPPED]),
            nan_iterations=int(values[m.NAN]), samples_per_second=interval.samples / seconds,
            tflops=rate.tflops, model_tflops=rate.model_tflops, mfu_percent=rate.mfu_percent)
        logger.info(format_iteration_line(stats))
        self.writer.write_iteration(stats, self.progress.iteration)

    def _memory_report(self) -> None:
        params = list(self.engine.stage.parameters())
        expected = memory.analytic(sum(p.numel() for p in params), params[0].element_size(),
                                   self.cfg.parallel.zero_stage, self.dp.size,
                                   memory.live_numel(self.data_parallel))
        every_rank_logger().info(memory.report("memory after the first step:", expected,
                                               memory.measured(self.optimizer,
                                                               self.data_parallel)))

    def _peak_tflops(self) -> float | None:
        return self.cfg.logging.peak_tflops or devices.peak_tflops(self.device)

    def _evaluate(self) -> None:
        loss = evaluate(self.engine, self.valid_batches, self.cfg.training.eval_iters, self.dp)
        logger.info(format_eval_line(self.progress.iteration, loss))
        self.writer.write_eval(loss, self.progress.iteration)
