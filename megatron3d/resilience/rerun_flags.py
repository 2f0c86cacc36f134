"""The flag combinations of --rerun-on-bad-step that cannot work, refused before any process
starts (``validation.validate`` asks here: the rules' owner is the bad-step re-run)."""

from __future__ import annotations

import dataclasses

from megatron3d.config import ResilienceConfig
from megatron3d.errors import ConfigError

_SETTINGS = ("rerun_spike_factor", "rerun_spike_window", "rerun_max_faults_per_rank")


def check_rerun_flags(resilience: ResilienceConfig) -> None:
    """A rerun setting given without the flag would be silently ignored: the user believes
    spikes are caught. The NaN stop ends the run at the very step the re-run would judge."""
    defaults = {f.name: f.default for f in dataclasses.fields(ResilienceConfig)}
    if not resilience.rerun_on_bad_step:
        for name in _SETTINGS:
            value = getattr(resilience, name)
            if value != defaults[name]:
                flag = "--" + name.replace("_", "-")
                raise ConfigError(f"{flag}={value} has no effect without --rerun-on-bad-step: "
                                  "add it, or drop the flag")
    elif resilience.check_for_nan_in_loss_and_grad:
        raise ConfigError("--rerun-on-bad-step re-runs a non-finite step to tell bad data from "
                          "a faulty rank, while --check-for-nan-in-loss-and-grad stops the run "
                          "at it: give one of the two")
