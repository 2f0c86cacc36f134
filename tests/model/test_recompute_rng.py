"""Activation recompute replays dropout exactly when the model-parallel RNG stream is in use.

torch's checkpoint restores the default generator for the recompute, but attention dropout
draws from the ``RNGStreams`` model-parallel stream (``LayerContext.rng``), which it knows
nothing about; ``TransformerLayer._recompute_contexts`` replays that stream. With it, a
recomputed model gives bitwise the loss and gradients of the plain model; without it, the
recompute draws other attention-dropout masks and the gradients differ.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import pytest
import torch

from megatron3d.model.context import LayerContext
from megatron3d.model.gpt import build_gpt, lm_loss
from megatron3d.model.transformer import TransformerLayer
from megatron3d.mpu.meta import get_meta
from megatron3d.mpu.random import RNGStreams
from megatron3d.mpu.state import AxisGroup
from tests.helpers.tiny import FLAVOURS, model_config

CPU = torch.device("cpu")
SEED = 1234
DROPOUT = {"hidden_dropout": 0.2, "attention_dropout": 0.2}


@dataclass
class Run:
    losses: list[torch.Tensor]  # one per micro-batch
    grads: dict[str, torch.Tensor]
    rng_after: dict[str, torch.Tensor]  # where every stream ended up


def _run(flavour: str, recompute: bool, **overrides: float) -> Run:
    """Build, forward and backward two micro-batches; streams created afresh from SEED."""
    cfg = model_config(flavour, checkpoint_activations=recompute, **{**DROPOUT, **overrides})
    rng = RNGStreams.create(SEED, tp_rank=0, pp_rank=0, dev=CPU)  # also reseeds the default stream
    ctx = LayerContext(cfg, AxisGroup.single(), SEED, torch.float32, CPU, rng)
    model = build_gpt(ctx)
    model.train()
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(2):  # two micro-batches: the second starts from advanced streams
        data = torch.randint(0, cfg.vocab_size, (3, cfg.seq_length + 1), generator=gen)
        loss = lm_loss(model(data[:, :-1]), data[:, 1:], torch.ones(3, cfg.seq_length), ctx)
        loss.backward()
        losses.append(loss.detach())
    grads = {get_meta(p).name: p.grad.clone() for p in model.parameters()}
    return Run(losses, grads, rng.get_state())


def _differing(a: Run, b: Run) -> list[str]:
    return [name for name, g in a.grads.items() if not torch.equal(g, b.grads[name])]


@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
def test_recompute_with_rng_streams_is_bitwise_identical(flavour):
    plain = _run(flavour, recompute=False)
    recomputed = _run(flavour, recompute=True)
    assert all(map(torch.equal, recomputed.losses, plain.losses))
    assert _differing(recomputed, plain) == []
    # The replay restores the streams afterwards: the next step draws what it would have.
    assert recomputed.rng_after.keys() == plain.rng_after.keys()
    for name, state in plain.rng_after.items():
        assert torch.equal(recomputed.rng_after[name], state), name
    # Dropout really is on: without it the same model gives another loss.
    no_dropout = _run(flavour, recompute=False, hidden_dropout=0.0, attention_dropout=0.0)
    assert not torch.equal(no_dropout.losses[0], plain.losses[0])


def test_without_the_replay_recompute_changes_the_gradients(monkeypatch):
    """The test above can fail: drop the replay and attention dropout is redrawn."""
    plain = _run("gpt2", recompute=False)

    def no_replay(self: TransformerLayer) -> tuple:
        return contextlib.nullcontext(), contextlib.nullcontext()

    monkeypatch.setattr(TransformerLayer, "_recompute_contexts", no_replay)
    broken = _run("gpt2", recompute=True)
    # The first forward is the same; its backward recomputes attention with other masks, and
    # leaves the stream advanced, so even the second micro-batch's forward draws differently.
    assert torch.equal(broken.losses[0], plain.losses[0])
    assert not torch.equal(broken.losses[1], plain.losses[1])
    differing = _differing(broken, plain)
    assert any(".attention.qkv." in name for name in differing), differing
    assert len(differing) > len(plain.grads) // 2, differing
    stream = "stream:model-parallel"
    assert not torch.equal(broken.rng_after[stream], plain.rng_after[stream])
