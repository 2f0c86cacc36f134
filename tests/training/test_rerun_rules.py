"""--rerun-on-bad-step's rules without processes: what counts as a loss spike, which ranks a
difference between a step and its re-run names, and the flag combinations refused up front."""

from __future__ import annotations

import math

import pytest

from megatron3d.cli.arguments import parse_args
from megatron3d.errors import ConfigError
from megatron3d.training.rerun import LossWindow, attribute
from megatron3d.validation import validate
from tests.helpers.tiny import train_argv


def test_a_spike_is_above_factor_times_the_mean_of_a_full_window():
    window = LossWindow(factor=3.0, size=3, losses=[])
    for loss in (4.0, 2.0):
        assert not window.is_spike(100.0)  # fewer than ``size`` losses: no judgement yet
        window.add(loss)
    window.add(3.0)  # mean 3
    assert not window.is_spike(9.0) and window.is_spike(9.000001)
    window.add(6.0)  # the oldest (4) leaves: mean (2 + 3 + 6) / 3
    assert window.losses == [2.0, 3.0, 6.0]
    assert window.is_spike(11.01) and not window.is_spike(10.99)


def test_a_window_of_zero_checks_no_spikes():
    window = LossWindow(factor=3.0, size=0, losses=[])
    window.add(1.0)
    assert not window.is_spike(1e30) and window.losses == []


@pytest.mark.parametrize(("differs", "named"), [
    ([(0, 0), (0, 0), (0, 0)], []),  # the same result everywhere: the data
    ([(0, 1), (1, 1), (0, 1)], [1]),  # rank 1's own work differed; the reduction spread it
    ([(0, 0), (0, 1), (0, 0)], [1]),  # differed only after the reductions: rank 1's copy
    ([(1, 1), (0, 1), (1, 1)], [0, 2]),
])
def test_the_ranks_named_are_those_that_differed_first(differs, named):
    assert attribute(differs) == named


@pytest.mark.parametrize("flags", [("--rerun-spike-factor", "2.0"),
                                   ("--rerun-spike-window", "5"),
                                   ("--rerun-max-faults-per-rank", "4")])
def test_rerun_settings_need_the_flag(flags):
    with pytest.raises(ConfigError, match=f"^{flags[0]}={flags[1]} has no effect without "
                       "--rerun-on-bad-step: add it, or drop the flag$"):
        validate(parse_args(train_argv("gpt2", 3, *flags)), 1)
    validate(parse_args(train_argv("gpt2", 3, "--rerun-on-bad-step", *flags)), 1)


def test_rerun_and_the_nan_stop_are_refused_together():
    with pytest.raises(ConfigError, match="^--rerun-on-bad-step re-runs a non-finite step"):
        validate(parse_args(train_argv("gpt2", 3, "--rerun-on-bad-step",
                                       "--check-for-nan-in-loss-and-grad")), 1)


@pytest.mark.parametrize(("flag", "value"), [("--rerun-spike-factor", "1"),
                                             ("--rerun-spike-factor", "nan"),
                                             ("--rerun-max-faults-per-rank", "0")])
def test_rerun_settings_out_of_range(flag, value):
    with pytest.raises(ConfigError, match=flag):
        validate(parse_args(train_argv("gpt2", 3, "--rerun-on-bad-step", flag, value)), 1)


def test_defaults():
    resilience = parse_args(train_argv("gpt2", 3)).resilience
    assert not resilience.rerun_on_bad_step
    assert (resilience.rerun_spike_factor, resilience.rerun_spike_window,
            resilience.rerun_max_faults_per_rank) == (3.0, 20, 2)
    assert math.isfinite(resilience.rerun_spike_factor)
