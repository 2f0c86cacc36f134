"""Each working set of ``accounting/transients.py`` against the peak of the tensor storage
a real CPU backward creates (``PeakMemory``), in bf16, each parameter's gradient freed by a
hook as ``zero/buffers.py`` does: a transformer layer's backward for every flavour and
recompute, at two shapes (weights larger than activations, and the reverse); the input
embedding's backward; the LM head's forward and backward with the loss."""

from __future__ import annotations

import pytest
import torch

from megatron3d.accounting.activations import PeakMemory
from megatron3d.accounting.in_flight import Activations
from megatron3d.accounting.transients import backward_working_set
from megatron3d.config import ModelConfig
from megatron3d.model.context import LayerContext
from megatron3d.model.gpt import gpt_layer_specs, lm_loss
from megatron3d.model.transformer import TransformerLayer
from megatron3d.mpu.random import RNGStreams
from megatron3d.mpu.state import AxisGroup
from tests.helpers.tiny import FLAVOURS

TRANSIENT_RTOL = 0.10
BF16, CPU, MICRO_BATCH = torch.bfloat16, torch.device("cpu"), 2
SHAPES = {"weights": {"hidden_size": 256, "seq_length": 64},
          "tokens": {"hidden_size": 128, "seq_length": 512}}


def _context(flavour: str, recompute: str | None = None, **shape) -> LayerContext:
    cfg = ModelConfig(**{"num_layers": 1, "num_attention_heads": 4, "vocab_size": 4000,
                         "hidden_dropout": 0.1, "attention_dropout": 0.0, **shape,
                         **FLAVOURS[flavour], "recompute_granularity": recompute})
    return LayerContext(cfg, AxisGroup.single(), 1, BF16, CPU, RNGStreams.create(1, 0, 0, CPU))


def _freeing_grads(module: torch.nn.Module) -> torch.nn.Module:
    """Each gradient freed once computed, as the fp32 buffers' hook does after adding it."""
    for p in module.parameters():
        p.register_post_accumulate_grad_hook(lambda q: setattr(q, "grad", None))
    return module.train()


def _model(ctx: LayerContext, names: list[str]) -> int:
    sizes = Activations(ctx.cfg, MICRO_BATCH, 1, False, BF16, "cpu")
    return backward_working_set(sizes, names, ctx.cfg.padded_vocab_size(1))


def _close(ours: int, real: int) -> bool:
    return abs(ours - real) <= TRANSIENT_RTOL * real


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("recompute", [None, "selective", "full"])
@pytest.mark.parametrize("flavour", list(FLAVOURS))
def test_a_layers_backward(flavour, recompute, shape):
    ctx = _context(flavour, recompute, **SHAPES[shape])
    layer = _freeing_grads(TransformerLayer(ctx, 0))
    x = torch.randn(ctx.cfg.seq_length, MICRO_BATCH, ctx.cfg.hidden_size, dtype=BF16,
                    requires_grad=True)
    y = layer(x)
    with PeakMemory() as peak:
        y.backward(torch.randn_like(y))
    assert _close(_model(ctx, ["TransformerLayer"]), peak.peak), peak.peak


@pytest.mark.parametrize("flavour", list(FLAVOURS))
def test_the_input_embeddings_backward(flavour):
    ctx = _context(flavour, **SHAPES["tokens"])
    embedding = _freeing_grads(gpt_layer_specs(ctx)[0].build())
    y = embedding(torch.randint(0, ctx.cfg.vocab_size, (MICRO_BATCH, ctx.cfg.seq_length)))
    with PeakMemory() as peak:
        y.backward(torch.randn_like(y))
    assert _close(_model(ctx, ["InputEmbedding"]), peak.peak), peak.peak


@pytest.mark.parametrize("flavour", list(FLAVOURS))
def test_the_heads_logits_loss_and_weight_gradient(flavour):
    """Forward and backward together: the loss's fp32 buffer (kept in flight until the
    backward) and the head's working set."""
    ctx = _context(flavour, **SHAPES["tokens"])
    head = _freeing_grads(gpt_layer_specs(ctx)[-1].build())
    s, vocab = ctx.cfg.seq_length, ctx.cfg.vocab_size
    x = torch.randn(s, MICRO_BATCH, ctx.cfg.hidden_size, dtype=BF16, requires_grad=True)
    labels = torch.randint(0, vocab, (MICRO_BATCH, s))
    with PeakMemory() as peak:
        lm_loss(head(x), labels, torch.ones(MICRO_BATCH, s), ctx).backward()
    sizes = Activations(ctx.cfg, MICRO_BATCH, 1, False, BF16, "cpu")
    ours = sizes.loss(ctx.cfg.padded_vocab_size(1)) + _model(ctx, ["OutputEmbedding"])
    assert _close(ours, peak.peak), (ours, peak.peak)
