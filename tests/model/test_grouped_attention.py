"""Grouped-query attention shares each key/value head among its query heads without copying
it per query head, with the numerics of the copies (``Path.COPY``, what the model did before,
is the oracle).

On the CPU, SDPA's flash kernel has a grouped path without attention dropout (``KERNEL``);
with dropout only the math kernel runs, and the query heads are folded into rows (``FOLD``).
Against the copies: the output and the query gradient are bitwise equal (the same dropout
mask included); the key and value gradients are summed over a group inside the kernel, so
they differ in the last bits: fp32 within rtol 1e-5, bf16 within one bf16 step (2^-7) of the
largest gradient. What one attention layer keeps for backward drops by exactly the two copies.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.nn.attention import SDPBackend

from megatron3d.accounting.activations import saved_bytes
from megatron3d.model import grouped_attention
from megatron3d.model.attention import SelfAttention
from megatron3d.model.context import LayerContext
from megatron3d.model.grouped_attention import Path, attention, grouped_path
from megatron3d.model.positional import alibi_causal_bias, alibi_slopes
from megatron3d.mpu.random import RNGStreams
from megatron3d.mpu.state import AxisGroup
from tests.helpers.tiny import model_config, two_micro_batches
from tests.helpers.tolerances import FP32

CPU = torch.device("cpu")
B, HEADS, GROUPS, S, D = 2, 8, 2, 32, 16
GQA = {"num_attention_heads": HEADS, "group_query_attention": True, "num_query_groups": GROUPS}


def force(monkeypatch: pytest.MonkeyPatch, path: Path) -> None:
    monkeypatch.setattr(grouped_attention, "grouped_path", lambda *args: path)


def _inputs(dtype: torch.dtype, alibi: bool) -> tuple[list[torch.Tensor], torch.Tensor,
                                                       torch.Tensor | None]:
    """q [b, n, s, d], k, v [b, G, s, d] as the model makes them (permuted views of one
    [s, b, G, n/G + 2, d] tensor), an output gradient, and the ALiBi bias or None."""
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(S, B, GROUPS, HEADS // GROUPS + 2, D, generator=gen).to(dtype)
    q, k, v = qkv.split([HEADS // GROUPS, 1, 1], dim=3)
    q = q.reshape(S, B, HEADS, D).permute(1, 2, 0, 3)
    k, v = (t.squeeze(3).permute(1, 2, 0, 3) for t in (k, v))
    bias = alibi_causal_bias(alibi_slopes(HEADS), S, dtype, CPU) if alibi else None
    return [q, k, v], torch.randn(B, HEADS, S, D, generator=gen).to(dtype), bias


def _run(inputs: list[torch.Tensor], grad: torch.Tensor, bias: torch.Tensor | None,
         p: float) -> list[torch.Tensor]:
    """(output, dq, dk, dv), dropout drawn from the same seed every time."""
    q, k, v = (t.detach().clone().requires_grad_() for t in inputs)
    torch.manual_seed(5)
    out = attention(q, k, v, bias, p)
    out.backward(grad)
    return [out.detach(), q.grad, k.grad, v.grad]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("alibi", [False, True], ids=["causal", "alibi"])
@pytest.mark.parametrize(("p", "path"), [(0.0, Path.KERNEL), (0.2, Path.FOLD)])
def test_shared_keys_and_values_match_the_copies(monkeypatch, dtype, alibi, p, path):
    inputs, grad, bias = _inputs(dtype, alibi)
    assert grouped_path(*inputs, bias, p) is path
    out, dq, dk, dv = _run(inputs, grad, bias, p)
    force(monkeypatch, Path.COPY)
    ref_out, ref_dq, ref_dk, ref_dv = _run(inputs, grad, bias, p)
    assert torch.equal(out, ref_out)  # with dropout: the same mask
    assert torch.equal(dq, ref_dq)
    for got, ref in ((dk, ref_dk), (dv, ref_dv)):
        if dtype == torch.float32:
            torch.testing.assert_close(got, ref, **FP32)
        else:
            step = 2.0 ** -7 * ref.abs().max().item()
            torch.testing.assert_close(got, ref, rtol=0.0, atol=step)


@pytest.mark.parametrize(("grouped", "multi_head", "alibi", "path"), [
    (SDPBackend.FLASH_ATTENTION, SDPBackend.FLASH_ATTENTION, False, Path.KERNEL),
    (SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, True, Path.KERNEL),
    (SDPBackend.MATH, SDPBackend.MATH, False, Path.FOLD),
    (SDPBackend.MATH, SDPBackend.EFFICIENT_ATTENTION, True, Path.FOLD),
    (SDPBackend.MATH, SDPBackend.EFFICIENT_ATTENTION, False, Path.COPY)])
def test_the_path_follows_the_kernel_sdpa_would_run(monkeypatch, grouped, multi_head, alibi,
                                                    path):
    """As on CUDA: flash and cuDNN share grouped heads; a causal copy that would run the
    memory-efficient kernel stays a copy (folding would hand it an explicit mask)."""
    def choice(q, k, v, *args, enable_gqa=False):
        return int((grouped if enable_gqa else multi_head).value)

    monkeypatch.setattr(torch, "_fused_sdp_choice", choice)
    inputs, _, bias = _inputs(torch.float32, alibi)
    assert grouped_path(*inputs, bias, 0.0) is path


def _layer_saved(flavour: str, dtype: torch.dtype, p: float) -> tuple[int, set[str]]:
    """Bytes one GQA attention layer keeps for backward (parameters and the ALiBi bias left
    out) and the operators its forward and backward run."""
    cfg = model_config(flavour, hidden_size=HEADS * D, seq_length=S, attention_dropout=p,
                       **GQA)
    ctx = LayerContext(cfg, AxisGroup.single(), 1, dtype, CPU, RNGStreams.create(1, 0, 0, CPU))
    layer = SelfAttention(ctx, "attention").train()
    constants = [*layer.parameters(), *layer.buffers()]
    if flavour == "bloom":
        constants.append(ctx.alibi.get(S, dtype, CPU))
    x = torch.randn(S, B, HEADS * D, dtype=dtype, requires_grad=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        size, out = saved_bytes(functools.partial(layer, x), constants)
        out.float().sum().backward()
    return size, {event.key for event in prof.key_averages()}


@pytest.mark.parametrize("flavour", ["gpt2", "bloom", "llama"])
@pytest.mark.parametrize(("dtype", "p"), [(torch.bfloat16, 0.0), (torch.float32, 0.0),
                                          (torch.float32, 0.2)])
def test_one_layer_keeps_no_keys_or_values_per_query_head(monkeypatch, flavour, dtype, p):
    """8 query heads in 2 groups: the copies kept k and v [b, 8, s, d] (the math kernel
    keeps them scaled, in fp32); now k and v [b, 2, s, d] are kept: 2 (8 - 2) b s d fewer
    elements, and nothing repeats them."""
    shared, ops = _layer_saved(flavour, dtype, p)
    force(monkeypatch, Path.COPY)
    copied, copy_ops = _layer_saved(flavour, dtype, p)
    assert "aten::repeat_interleave" in copy_ops and "aten::repeat_interleave" not in ops
    element = dtype.itemsize if p == 0.0 else 4
    assert copied - shared == 2 * (HEADS - GROUPS) * B * S * D * element


def _train(flavour: str, recompute: str | None, dropout: float) -> tuple[list, dict]:
    """Two micro-batches of a GQA model forward and backward: (losses, gradients)."""
    cfg = model_config(flavour, recompute_granularity=recompute, hidden_dropout=dropout,
                       attention_dropout=dropout, hidden_size=HEADS * 4, **GQA)
    losses, grads, _ = two_micro_batches(cfg)
    return losses, grads


@pytest.mark.parametrize("dropout", [0.0, 0.2])
@pytest.mark.parametrize("flavour", ["llama", "bloom"], ids=["rope", "alibi"])
def test_a_model_trains_as_with_copies_under_selective_recompute(monkeypatch, flavour,
                                                                   dropout):
    """The same losses bitwise (dropout masks included) and gradients within fp32 rounding;
    selective recompute re-runs the shared core bitwise."""
    losses, grads = _train(flavour, None, dropout)
    selective = _train(flavour, "selective", dropout)
    assert all(map(torch.equal, selective[0], losses))
    assert all(torch.equal(selective[1][name], g) for name, g in grads.items())
    force(monkeypatch, Path.COPY)
    copied_losses, copied_grads = _train(flavour, None, dropout)
    assert all(map(torch.equal, copied_losses, losses))
    for name, g in grads.items():
        torch.testing.assert_close(g, copied_grads[name], **FP32, msg=name)
