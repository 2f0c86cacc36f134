"""One process: the per-block kernel (fused and its fallback agree) and the online-softmax
merge of two key blocks equals one block over all the keys."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from megatron3d.cp import block
from tests.helpers.tolerances import FP32


def _qkv(n: int = 4, g: int = 2, sq: int = 8, sk: int = 12, d: int = 8) -> tuple:
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(2, h, s, d, generator=gen) for h, s in ((n, sq), (g, sk), (g, sk)))


def _hiding(sq: int, sk: int, hidden_rows: tuple[int, ...] = ()) -> torch.Tensor:
    """An additive mask [1, 1, sq, sk] with a few keys and the given rows hidden."""
    bias = torch.zeros(1, 1, sq, sk)
    bias[..., 3] = float("-inf")
    for row in hidden_rows:
        bias[..., row, :] = float("-inf")
    return bias


@pytest.mark.parametrize(("causal", "masked"), [(False, True), (True, False), (True, True)])
def test_fused_and_fallback_agree(causal: bool, masked: bool) -> None:
    q, k, v = _qkv(sk=8)
    bias = _hiding(8, 8, hidden_rows=(2,)) if masked else None
    fused, fallback = (block.forward(q, k, v, bias, causal, fused=f) for f in (True, False))
    for a, b in zip(fused, fallback, strict=True):
        torch.testing.assert_close(a, b, **FP32)
    assert torch.isneginf(fused[1][:, :, 2]).all() == masked  # a row that sees no key
    # Backward reads a final lse, finite in every row (each query sees at least itself).
    bias = _hiding(8, 8) if masked else None
    out, lse = block.forward(q, k, v, bias, causal)
    grad = torch.randn_like(q)
    grads = [block.backward(grad, q, k, v, out, lse, bias, causal, fused=f) for f in (True, False)]
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, **FP32)


def test_two_blocks_merged_equal_one_block() -> None:
    q, k, v = _qkv()
    bias = _hiding(8, 12)
    bias[..., 1, :6] = float("-inf")  # row 1 sees no key of the first block
    whole_out, whole_lse = block.forward(q, k, v, bias, False)
    out, lse = block.forward(q, k[:, :, :6], v[:, :, :6], bias[..., :6], False)
    out = out.float()
    part_out, part_lse = block.forward(q, k[:, :, 6:], v[:, :, 6:], bias[..., 6:], False)
    block.merge_(out, lse, part_out, part_lse)
    torch.testing.assert_close(out, whole_out, **FP32)
    torch.testing.assert_close(lse, whole_lse, **FP32)


@pytest.mark.parametrize("fused", [True, False])
def test_causal_attention_under_a_mask_is_sdpa_under_it(fused: bool) -> None:
    q, k, v = (t.requires_grad_() for t in _qkv(sk=8))
    bias = _hiding(8, 8).masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf"))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias,
                                                            enable_gqa=True)
    with mock.patch.object(block, "_FLASH_CPU", block._FLASH_CPU if fused else None):
        got = block.causal_attention(q, k, v, bias, 0.0)
    grad = torch.randn_like(want)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), grad),
                    torch.autograd.grad(want, (q, k, v), grad), strict=True):
        torch.testing.assert_close(a, b, **FP32)
    torch.testing.assert_close(got, want, **FP32)
