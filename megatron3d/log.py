"""The only logging module: rank-aware logger setup and the Megatron iteration line.

Only one rank (the caller picks it; Megatron logs from the last pipeline stage, which holds the
loss) prints INFO; every other rank prints WARNING and above, prefixed with its rank. INFO
lines carry no timestamp or level, so the iteration line reads exactly like Megatron's and
existing log parsers keep working. Everything here takes plain Python numbers that the
training loop has already synced at the log interval; nothing touches a device tensor.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

_HANDLER_TAG = "_megatron3d_handler"
EVERY_RANK = "megatron3d.every_rank"


def get_logger(name: str) -> logging.Logger:
    """Logger for a module; call with ``__name__``."""
    return logging.getLogger(name)


def every_rank_logger() -> logging.Logger:
    """INFO from every rank, each line prefixed with its rank (per-rank reports)."""
    return logging.getLogger(EVERY_RANK)


class _RankFormatter(logging.Formatter):
    """INFO and below as the bare message; warnings and errors with level, rank and logger."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self._rank = rank

    def format(self, record: logging.LogRecord) -> str:
        message = super().format(record)
        if record.name == EVERY_RANK:
            return "\n".join(f"[rank {self._rank}] {line}" for line in message.splitlines())
        if record.levelno < logging.WARNING:
            return message
        return f"[rank {self._rank}] {record.levelname} {record.name}: {message}"


def setup_logging(rank: int, log_rank: int, level: str | int = "INFO") -> None:
    """Configure the root logger once per process; calling it again replaces our handlers.

    ``log_rank`` logs at ``level``; the other ranks at WARNING or higher. Records below
    WARNING go to stdout, the rest to stderr.
    """
    root = logging.getLogger()
    for handler in [h for h in root.handlers if getattr(h, _HANDLER_TAG, False)]:
        root.removeHandler(handler)
    wanted = logging.getLevelName(level) if isinstance(level, str) else level
    if not isinstance(wanted, int):
        raise ValueError(f"unknown log level {level!r}")
    root.setLevel(wanted if rank == log_rank else max(wanted, logging.WARNING))
    every_rank_logger().setLevel(wanted)
    formatter = _RankFormatter(rank)
    out = logging.StreamHandler(sys.stdout)
    out.addFilter(lambda record: record.levelno < logging.WARNING)
    err = logging.StreamHandler(sys.stderr)
    err.setLevel(logging.WARNING)
    for handler in (out, err):
        handler.setFormatter(formatter)
        setattr(handler, _HANDLER_TAG, True)
        root.addHandler(handler)


@dataclass(frozen=True)
class IterationStats:
    """One log interval, as plain Python numbers (already synced with the device).

    elapsed_s: seconds per iteration averaged over the interval. lm_loss: interval average,
    None when every step was skipped or NaN. grad_norm / num_zeros / params_norm: None when not
    computed.
    tflops: hardware TFLOP/s per GPU (recomputation included). model_tflops: set only when
    activation recomputation makes it differ from ``tflops``. mfu_percent: None when the peak
    of the device is unknown.
    """

    iteration: int
    train_iters: int
    consumed_samples: int
    consumed_tokens: int
    elapsed_s: float
    learning_rate: float
    global_batch_size: int
    lm_loss: float | None
    loss_scale: float
    grad_norm: float | None
    num_zeros: float | None
    skipped_iterations: int
    nan_iterations: int
    samples_per_second: float
    tflops: float
    model_tflops: float | None = None
    mfu_percent: float | None = None
    params_norm: float | None = None


def format_iteration_line(stats: IterationStats) -> str:
    """Megatron's iteration line, field order and widths kept, plus our optional fields."""
    fields = [
        f" iteration {stats.iteration:8d}/{stats.train_iters:8d} |",
        f" consumed samples: {stats.consumed_samples:12d} |",
        f" consumed tokens: {stats.consumed_tokens:12d} |",
        f" elapsed time per iteration (s): {stats.elapsed_s:.4f} |",
        f" learning rate: {stats.learning_rate:.3E} |",
        f" global batch size: {stats.global_batch_size:5d} |",
    ]
    if stats.lm_loss is not None:
        fields.append(f" lm loss: {stats.lm_loss:.6E} |")
    fields.append(f" loss scale: {stats.loss_scale:.1f} |")
    if stats.grad_norm is not None:
        fields.append(f" grad norm: {stats.grad_norm:.3f} |")
    if stats.num_zeros is not None:
        fields.append(f" num zeros: {stats.num_zeros:.1f} |")
    if stats.params_norm is not None:
        fields.append(f" params norm: {stats.params_norm:.3f} |")
    fields += [
        f" number of skipped iterations: {stats.skipped_iterations:3d} |",
        f" number of nan iterations: {stats.nan_iterations:3d} |",
        f" samples per second: {stats.samples_per_second:.3f} |",
        f" TFLOPs: {stats.tflops:.2f} |",
    ]
    if stats.model_tflops is not None:
        fields.append(f" model TFLOPs: {stats.model_tflops:.2f} |")
    if stats.mfu_percent is not None:
        fields.append(f" MFU: {stats.mfu_percent:.1f}% |")
    return "".join(fields)
