"""When to stop early: SLURM's warning signal, a time budget, an iteration count or a kill
switch file, decided alike on every rank without a host sync in any step.

``--exit-interval`` is a function of the iteration, the same on every rank: it stops exactly
there, with no communication. The other reasons may differ between ranks (SIGTERM and SIGUSR1,
what SLURM and torchrun send before killing a job, only set a flag, and may reach ranks at
different moments or not at all; clocks and a file are seen at different moments), yet every
rank must stop after the same iteration or its next collective hangs. So they are agreed, one
step late: after each step every rank starts an asynchronous MAX all-reduce of its flags over
the world and reads the result after the next step, when it has long arrived (on GPUs it comes
back into pinned host memory on a side stream: ``device.HostRoundTrip``). A signal that arrives
during step i stops every rank after step i + 1; what is there when training starts (a kill
switch file, a time budget spent on start-up and loading) stops it after step 1; after the
run's last step the flags are agreed at once (a signal then still skips the end-of-run
evaluation).

Every step rather than every N: the check is a 12-byte all-reduce off the compute stream and
no host wait for the device, while each step between a signal and the save eats into the
grace time SLURM gives (``--signal=B:USR1@N``). None of it runs unless ``--save`` (which turns
a signal into a clean exit), ``--exit-duration-in-mins`` or ``--kill-switch-path`` is set. The
agreed reasons are named in the stop line and in the run's summary.
"""

from __future__ import annotations

import os
import signal
import time

import torch

from megatron3d import device as devices
from megatron3d.config import CheckpointConfig
from megatron3d.mpu import comm
from megatron3d.mpu.state import AxisGroup

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class ExitWatch:
    """Enter it around the training loop (signal handlers, the first check); call
    ``should_stop`` after every step."""

    def __init__(self, cfg: CheckpointConfig, world: AxisGroup, device: torch.device,
                 started: float | None = None) -> None:
        """``started``: ``time.monotonic()`` when the job started (--exit-duration-in-mins
        counts start-up and checkpoint loading too); default now."""
        self.cfg, self.world = cfg, world
        self.start = time.monotonic() if started is None else started
        self.signalled = 0  # the number of the last signal received, 0 for none
        self.pressed = False  # agreed: a signal, the time budget or the kill switch stopped it
        agreeing = bool(cfg.save or cfg.exit_duration_in_mins or cfg.kill_switch_path)
        # (signal number, out of time, kill switch) to the device and back; NCCL reduces
        # device tensors
        self._flags = devices.HostRoundTrip(3, device) if agreeing else None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> ExitWatch:
        if self.cfg.save:  # only a run that can save turns a signal into a clean exit
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        if self._flags is not None:
            self._post()  # read after the first step
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame: object) -> None:
        self.signalled = signum

    def should_stop(self, iteration: int, last: bool = False) -> str | None:
        """Agreed by every rank: why to stop after this iteration (e.g. "signal SIGTERM",
        "--exit-interval 50"), or None to go on. ``last``: the run ends after this iteration
        anyway; the flags are then agreed at once instead of after a next step."""
        interval = self.cfg.exit_interval
        at_interval = bool(interval and iteration % interval == 0)
        agreed = [0.0, 0.0, 0.0]
        if self._flags is not None:
            agreed = self._flags.result()  # posted after the previous step: arrived by now
            if not (at_interval or any(agreed)):
                self._post()
                if last:
                    agreed = self._flags.result()
        signum, out_of_time, killed = agreed
        self.pressed = bool(signum or out_of_time or killed)
        reasons = []
        if signum:
            reasons.append(f"signal {signal.Signals(int(signum)).name}")
        if at_interval:
            reasons.append(f"--exit-interval {interval}")
        if out_of_time:
            reasons.append(f"--exit-duration-in-mins {self.cfg.exit_duration_in_mins}")
        if killed:
            reasons.append(f"kill switch {self.cfg.kill_switch_path}")
        return " and ".join(reasons) or None

    def _post(self) -> None:
        """Start agreeing on this rank's flags (the highest signal number any rank saw, and
        whether any is out of time or sees the kill switch); read by the next ``should_stop``."""
        minutes = (time.monotonic() - self.start) / 60.0
        duration, switch = self.cfg.exit_duration_in_mins, self.cfg.kill_switch_path
        mine = self._flags.send([float(self.signalled),
                                 float(bool(duration and minutes >= duration)),
                                 float(bool(switch and os.path.exists(switch)))])
        self._flags.start(mine, comm.start_all_reduce(mine, self.world, tag="exit watch",
                                                      op=comm.MAX))
