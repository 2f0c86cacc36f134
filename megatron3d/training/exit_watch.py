"""When to stop early: SLURM's warning signal, a time budget, or an iteration count.

SIGTERM and SIGUSR1 (what SLURM and torchrun send before killing a job) only set a flag; the
training loop checks it at the next step boundary. Ranks may see a signal at different moments
(or not at all), so the decision is agreed: one all-reduce of a flag per step, made only when
an exit condition is configured.
"""

from __future__ import annotations

import signal
import time

import torch

from megatron3d.config import CheckpointConfig
from megatron3d.mpu import comm
from megatron3d.mpu.state import AxisGroup

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class ExitWatch:
    def __init__(self, cfg: CheckpointConfig, world: AxisGroup, device: torch.device,
                 started: float | None = None) -> None:
        """``started``: ``time.monotonic()`` when the job started (--exit-duration-in-mins
        counts start-up and checkpoint loading too); default now."""
        self.cfg, self.world, self.device = cfg, world, device  # NCCL reduces device tensors
        self.start = time.monotonic() if started is None else started
        self.signalled = False
        self.active = bool(cfg.save or cfg.exit_interval or cfg.exit_duration_in_mins)
        self._previous: dict[int, object] = {}

    def __enter__(self) -> ExitWatch:
        if self.cfg.save:  # only a run that can save turns a signal into a clean exit
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame: object) -> None:
        self.signalled = True

    def should_stop(self, iteration: int) -> bool:
        """Agreed by every rank: stop after this iteration."""
        if not self.active:
            return False
        minutes = (time.monotonic() - self.start) / 60.0
        mine = (self.signalled
                or bool(self.cfg.exit_interval and iteration % self.cfg.exit_interval == 0)
                or bool(self.cfg.exit_duration_in_mins
                        and minutes >= self.cfg.exit_duration_in_mins))
        flag = torch.tensor([float(mine)], device=self.device)
        return comm.all_reduce(flag, self.world, op=comm.MAX).item() > 0
