"""When to stop early: SLURM's warning signal, a time budget, an iteration count or a kill
switch file.

SIGTERM and SIGUSR1 (what SLURM and torchrun send before killing a job) only set a flag; the
training loop checks it at the next step boundary. Ranks may see a signal at different moments
(or not at all), so the decision is agreed: one all-reduce of the reasons per step, made only
when an exit condition is configured. The agreed reasons are named in the stop line and in the
run's summary.
"""

from __future__ import annotations

import os
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
        self.signalled = 0  # the number of the last signal received, 0 for none
        self.pressed = False  # agreed: a signal, the time budget or the kill switch stopped it
        self.active = bool(cfg.save or cfg.exit_interval or cfg.exit_duration_in_mins
                           or cfg.kill_switch_path)
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
        self.signalled = signum

    def should_stop(self, iteration: int) -> str | None:
        """Agreed by every rank: why to stop after this iteration (e.g. "signal SIGTERM",
        "--exit-interval 50"), or None to go on."""
        if not self.active:
            return None
        minutes = (time.monotonic() - self.start) / 60.0
        interval, duration = self.cfg.exit_interval, self.cfg.exit_duration_in_mins
        switch = self.cfg.kill_switch_path
        mine = torch.tensor([float(self.signalled),  # the highest signal number any rank saw
                             float(bool(interval and iteration % interval == 0)),
                             float(bool(duration and minutes >= duration)),
                             float(bool(switch and os.path.exists(switch)))],
                            device=self.device)
        signum, at_interval, out_of_time, killed = comm.all_reduce(mine, self.world,
                                                                   op=comm.MAX).tolist()
        self.pressed = bool(signum or out_of_time or killed)
        reasons = []
        if signum:
            reasons.append(f"signal {signal.Signals(int(signum)).name}")
        if at_interval:
            reasons.append(f"--exit-interval {interval}")
        if out_of_time:
            reasons.append(f"--exit-duration-in-mins {duration}")
        if killed:
            reasons.append(f"kill switch {switch}")
        return " and ".join(reasons) or None
