"""What the run reports between evaluations: Megatron's iteration line every --log-interval
and TensorBoard scalars every --tensorboard-log-interval, with no host sync in between.

Each step adds its device-side results to the log line's ``IntervalMetrics`` and, on the rank
that writes TensorBoard, to a second one. A TensorBoard interval is taken without a sync and
kept until the next log line, whose one sync transfers them all, so a short TensorBoard
interval costs no stall. Throughput (time per iteration, samples/s, TFLOPs, MFU) and memory
are measured only at log lines, where the device has been synced. ``num zeros`` leaves out the
padded vocabulary rows, whose gradients are zero by construction. The parameters' norm is a
collective, so every rank computes it at the same iterations (it depends only on flags).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from megatron3d import device as devices
from megatron3d.accounting.flops import FlopsCount, flops_per_iteration, throughput
from megatron3d.checkpoint.progress import Progress
from megatron3d.config import TrainConfig
from megatron3d.log import IterationStats, format_iteration_line, get_logger
from megatron3d.training import metrics as m
from megatron3d.training.step import StepResult
from megatron3d.training.tensorboard import TensorBoardWriter

logger = get_logger(__name__)


@dataclass
class _Interval:
    """Host-side bookkeeping of the current log interval."""

    start_time: float = field(default_factory=time.perf_counter)
    samples: int = 0
    flops_hardware: int = 0
    flops_model: int = 0


@dataclass(frozen=True)
class _Pending:
    """A TensorBoard interval taken on the device, written at the next log line."""

    at: Progress  # a copy: the loop advances its own
    learning_rate: float
    global_batch_size: int
    taken: m.TakenInterval


class Reporter:
    """Built with the trainer; ``start`` when training starts, ``step`` after every optimizer
    step, ``finish`` at the end (pending TensorBoard intervals)."""

    def __init__(self, cfg: TrainConfig, writer: TensorBoardWriter, device: torch.device,
                 world_size: int, padded_vocab_size: int, total_iters: int,
                 params_norm: Callable[[], torch.Tensor]) -> None:
        self.cfg, self.writer, self.device = cfg, writer, device
        self.world_size, self.padded_vocab_size = world_size, padded_vocab_size
        self.total_iters, self.params_norm = total_iters, params_norm
        self._line = m.IntervalMetrics(device)
        self._board = m.IntervalMetrics(device) if writer.active else None
        self._pending: list[_Pending] = []
        self._interval = _Interval()
        model = cfg.model
        copies = 1 if model.tie_embeddings else 2  # input embedding, and an untied output
        self._padding_zeros = (padded_vocab_size - model.vocab_size) * model.hidden_size * copies

    def start(self) -> None:
        """Training starts now: the first log interval's time counts from here."""
        self._interval = _Interval()

    def step(self, at: Progress, result: StepResult, lr: float, gbs: int) -> bool:
        """Record one step ending at ``at``; True if it closed a log interval."""
        stats = result.stats
        for metrics in self._each():
            metrics.add_step(result.loss, stats.grad_norm, stats.num_zeros, stats.skipped,
                             stats.loss_scale, nan_grad=stats.nan)
        flops = flops_per_iteration(self.cfg.model, gbs, self.padded_vocab_size)
        self._interval.samples += gbs
        self._interval.flops_hardware += flops.hardware
        self._interval.flops_model += flops.model
        flags = self.cfg.logging
        logged = at.iteration % flags.log_interval == 0
        boarded = (bool(flags.tensorboard_dir)
                   and at.iteration % flags.tensorboard_log_interval == 0)
        if flags.log_params_norm and (logged or boarded):
            norm = self.params_norm()
            for metrics in self._each():
                metrics.set_params_norm(norm)
        if boarded and self._board is not None:
            self._pending.append(_Pending(dataclasses.replace(at), lr, gbs, self._board.take()))
        if logged:
            self._log(at, lr, gbs)
            self._write_pending()
        return logged

    def finish(self) -> None:
        """Write the TensorBoard intervals no log line has carried yet (one sync)."""
        self._write_pending()

    def _each(self) -> list[m.IntervalMetrics]:
        return [self._line] if self._board is None else [self._line, self._board]

    def _num_zeros(self, values: dict[str, float]) -> float | None:
        zeros = values.get(m.NUM_ZEROS)
        return None if zeros is None else zeros - self._padding_zeros

    def _log(self, at: Progress, lr: float, gbs: int) -> None:
        devices.synchronize(self.device)
        values = self._line.collect()
        interval, self._interval = self._interval, _Interval()
        steps = int(values[m.STEPS])
        seconds = time.perf_counter() - interval.start_time
        per_iter = seconds / steps
        peak = self.cfg.logging.peak_tflops or devices.peak_tflops(self.device)
        rate = throughput(FlopsCount(interval.flops_hardware // steps,
                                     interval.flops_model // steps),
                          per_iter, self.world_size, peak)
        stats = IterationStats(
            iteration=at.iteration, train_iters=self.total_iters,
            consumed_samples=at.consumed_samples, consumed_tokens=at.consumed_tokens,
            elapsed_s=per_iter, learning_rate=lr,
            global_batch_size=gbs, lm_loss=values.get(m.LM_LOSS),
            loss_scale=values.get(m.LOSS_SCALE, 1.0), grad_norm=values.get(m.GRAD_NORM),
            num_zeros=self._num_zeros(values), skipped_iterations=int(values[m.SKIPPED]),
            nan_iterations=int(values[m.NAN]), samples_per_second=interval.samples / seconds,
            tflops=rate.tflops, model_tflops=rate.model_tflops, mfu_percent=rate.mfu_percent,
            params_norm=values.get(m.PARAMS_NORM))
        logger.info(format_iteration_line(stats))
        self.writer.write({"iteration-time": per_iter,
                           "samples-per-second": stats.samples_per_second,
                           "TFLOPs": rate.tflops, "model TFLOPs": rate.model_tflops,
                           "MFU": rate.mfu_percent, **devices.memory_in_use(self.device)}, at)

    def _write_pending(self) -> None:
        if not self._pending:
            return
        host = torch.stack([p.taken.acc for p in self._pending]).tolist()  # the one sync
        for pending, row in zip(self._pending, host, strict=True):
            values = pending.taken.values(row)
            self.writer.write({
                "lm loss": values.get(m.LM_LOSS), "learning-rate": pending.learning_rate,
                "batch-size": pending.global_batch_size, "grad-norm": values.get(m.GRAD_NORM),
                "num-zeros": self._num_zeros(values), "params-norm": values.get(m.PARAMS_NORM),
                "loss-scale": values.get(m.LOSS_SCALE), "world-size": self.world_size,
                "skipped-iterations": values[m.SKIPPED], "nan-iterations": values[m.NAN],
            }, pending.at)
        self._pending.clear()
