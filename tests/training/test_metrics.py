"""Interval metrics: device-side accumulation, one host transfer, Megatron's averages."""

from __future__ import annotations

import pytest
import torch

from megatron3d.training.metrics import (
    GRAD_NORM,
    LM_LOSS,
    LOSS_SCALE,
    NAN,
    NUM_ZEROS,
    SKIPPED,
    STEPS,
    IntervalMetrics,
)

CPU = torch.device("cpu")


def t(value) -> torch.Tensor:
    return torch.tensor(value)


def add(metrics: IntervalMetrics, loss: float, skipped: bool = False, grad_norm: float = 1.0,
        num_zeros: float = 0.0, scale: float = 1.0, nan_grad: bool = False) -> None:
    metrics.add_step(t(loss), t(grad_norm), t(num_zeros), t(skipped), t(scale),
                     nan_grad=t(nan_grad))


def test_mean_over_clean_steps_and_last_values():
    metrics = IntervalMetrics(CPU)
    add(metrics, 4.0, grad_norm=2.0, scale=1024.0)
    add(metrics, 2.0, grad_norm=3.0, num_zeros=5.0, scale=2048.0)
    assert metrics.steps == 2
    result = metrics.collect()
    assert result == {STEPS: 2.0, SKIPPED: 0.0, NAN: 0.0, LM_LOSS: 3.0, GRAD_NORM: 3.0,
                      NUM_ZEROS: 5.0, LOSS_SCALE: 2048.0}


def test_skipped_and_nan_steps_stay_out_of_the_mean():
    metrics = IntervalMetrics(CPU)
    add(metrics, 1.0)
    add(metrics, 100.0, skipped=True)
    add(metrics, float("nan"))
    add(metrics, float("inf"), skipped=True)
    add(metrics, 3.0)
    result = metrics.collect()
    assert result[LM_LOSS] == 2.0
    assert result[SKIPPED] == 2.0
    assert result[NAN] == 2.0
    assert result[STEPS] == 5.0


def test_step_skipped_for_a_non_finite_grad_norm_is_skipped_and_nan_once():
    """bf16/fp32: a non-finite grad norm skips the step and counts as a NaN iteration, once
    even if the loss is NaN too; an fp16 overflow (skipped, finite loss) is not NaN."""
    metrics = IntervalMetrics(CPU)
    add(metrics, 2.0)
    add(metrics, 5.0, skipped=True, nan_grad=True)
    add(metrics, float("nan"), skipped=True, nan_grad=True)
    add(metrics, 7.0, skipped=True)
    result = metrics.collect()
    assert (result[SKIPPED], result[NAN], result[LM_LOSS]) == (3.0, 2.0, 2.0)


def test_collect_resets():
    metrics = IntervalMetrics(CPU)
    add(metrics, 5.0, skipped=True)
    metrics.collect()
    add(metrics, 7.0)
    result = metrics.collect()
    assert result[LM_LOSS] == 7.0
    assert result[SKIPPED] == 0.0
    assert metrics.steps == 0


def test_no_loss_when_every_step_was_skipped():
    metrics = IntervalMetrics(CPU)
    add(metrics, float("nan"), skipped=True)
    assert LM_LOSS not in metrics.collect()
    assert metrics.collect() == {STEPS: 0.0, SKIPPED: 0.0, NAN: 0.0}


def test_grad_norm_absent_when_last_step_has_none():
    metrics = IntervalMetrics(CPU)
    add(metrics, 1.0, grad_norm=2.0)
    metrics.add_step(t(1.0), None, None, t(False), t(1.0), nan_grad=t(False))
    result = metrics.collect()
    assert GRAD_NORM not in result and NUM_ZEROS not in result


def test_accepts_low_precision_and_integer_inputs():
    metrics = IntervalMetrics(CPU)
    metrics.add_step(torch.tensor(2.5, dtype=torch.bfloat16), torch.tensor([1.5]),
                     torch.tensor(3), torch.tensor(0, dtype=torch.int32), torch.tensor(1.0),
                     nan_grad=torch.tensor(False))
    result = metrics.collect()
    assert result[LM_LOSS] == 2.5
    assert result[GRAD_NORM] == 1.5
    assert result[NUM_ZEROS] == 3.0


def test_add_step_never_syncs_and_collect_transfers_once(monkeypatch):
    calls: list[str] = []
    real_tolist = torch.Tensor.tolist

    def forbid(name):
        def hook(self, *args, **kwargs):
            raise AssertionError(f"host sync via {name} on the hot path")
        return hook

    for name in ("item", "cpu", "numpy", "__bool__", "__float__", "__int__", "__format__"):
        monkeypatch.setattr(torch.Tensor, name, forbid(name))
    monkeypatch.setattr(torch.Tensor, "tolist", forbid("tolist"))
    metrics = IntervalMetrics(CPU)
    for step in range(3):
        add(metrics, float(step), skipped=step == 1)

    def counting_tolist(self):
        calls.append("tolist")
        return real_tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)
    result = metrics.collect()
    assert calls == ["tolist"]
    assert result[LM_LOSS] == pytest.approx(1.0)
