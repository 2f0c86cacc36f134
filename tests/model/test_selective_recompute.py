"""Selective recompute re-runs only the attention core in backward, with the same dropout.

With attention and hidden dropout on and the model-parallel RNG stream in use, a model under
``--recompute-granularity selective`` gives bitwise the losses, gradients and final RNG
states of the plain model; dropping the stream replay changes the gradients, and the core
really runs twice per micro-batch (and only once without gradients).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from megatron3d.model import grouped_attention
from megatron3d.model.context import LayerContext
from megatron3d.model.gpt import build_gpt, lm_loss
from megatron3d.mpu.state import AxisGroup
from tests.helpers.tiny import FLAVOURS, model_config, two_micro_batches

CPU, SEED = torch.device("cpu"), 1234


def _run(flavour: str, recompute: str | None) -> tuple[list, dict, dict]:
    """Two micro-batches forward and backward: (losses, gradients, RNG states after)."""
    cfg = model_config(flavour, recompute_granularity=recompute, hidden_dropout=0.2,
                       attention_dropout=0.2)
    losses, grads, rng = two_micro_batches(cfg, SEED)
    return losses, grads, rng.get_state()


def _differing(a: dict, b: dict) -> list[str]:
    return [name for name, value in a.items() if not torch.equal(value, b[name])]


@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
def test_selective_recompute_is_bitwise_identical_with_dropout(flavour):
    losses, grads, rng_after = _run(flavour, None)
    losses_sel, grads_sel, rng_after_sel = _run(flavour, "selective")
    assert all(map(torch.equal, losses_sel, losses))
    assert _differing(grads_sel, grads) == []
    assert rng_after_sel.keys() == rng_after.keys()
    assert _differing(rng_after_sel, rng_after) == []


def test_without_the_stream_replay_the_recomputed_dropout_differs(monkeypatch):
    """The test above can fail: attention dropout draws from the TP stream, which torch's
    checkpoint does not replay by itself."""
    _, grads, _ = _run("gpt2", None)
    monkeypatch.setattr(LayerContext, "recompute_contexts",
                        lambda self: (contextlib.nullcontext(), contextlib.nullcontext()))
    _, broken, _ = _run("gpt2", "selective")
    assert any(".attention.qkv." in name for name in _differing(broken, grads))


@pytest.mark.parametrize(("recompute", "grad", "expected"), [
    (None, True, 1), ("selective", True, 2), ("selective", False, 1), ("full", True, 2)])
def test_the_attention_core_runs_again_in_backward(monkeypatch, recompute, grad, expected):
    calls = []
    sdpa = grouped_attention.F.scaled_dot_product_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(grouped_attention.F, "scaled_dot_product_attention", counted)
    cfg = model_config("gpt2", num_layers=1, recompute_granularity=recompute)
    ctx = LayerContext(cfg, AxisGroup.single(), SEED, torch.float32, CPU)
    model = build_gpt(ctx).train()
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1))
    with torch.set_grad_enabled(grad):
        loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:], torch.ones(2, cfg.seq_length), ctx)
        if grad:
            loss.backward()
    assert len(calls) == expected
