"""TensorBoard scalars under Megatron's names, each plotted against the iteration and against
the consumed samples and tokens (Megatron's "vs samples" series, which stay comparable under a
batch-size ramp)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megatron3d.checkpoint.progress import Progress


class TensorBoardWriter:
    """Scalars under Megatron's names; a no-op unless enabled and given a directory.

    Enable it on the logging rank only. ``SummaryWriter`` is imported lazily so a run without
    TensorBoard never needs the package.
    """

    def __init__(self, log_dir: str | None, enabled: bool) -> None:
        self._writer: Any = None
        if enabled and log_dir:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=log_dir)

    @property
    def active(self) -> bool:
        return self._writer is not None

    def write(self, scalars: Mapping[str, float | None], at: Progress) -> None:
        """Each scalar (None: not measured, skipped) as three series: ``NAME`` vs the
        iteration, ``NAME vs samples`` and ``NAME vs tokens``."""
        if self._writer is None:
            return
        for name, value in scalars.items():
            if value is not None:
                self._writer.add_scalar(name, value, at.iteration)
                self._writer.add_scalar(f"{name} vs samples", value, at.consumed_samples)
                self._writer.add_scalar(f"{name} vs tokens", value, at.consumed_tokens)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
