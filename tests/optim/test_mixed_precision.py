"""The optimizer: equal to plain torch AdamW + clipping in fp32, fp32 accumulation under bf16,
fp16 overflow skipping, and skipping a non-finite step in bf16 and fp32."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megatron3d.config import OptimizerConfig, PrecisionConfig
from megatron3d.mpu.meta import ParamMeta, set_meta
from megatron3d.optim.mixed_precision import MixedPrecisionOptimizer
from tests.helpers.device import rank_device
from tests.helpers.flat import whole


class Tiny(nn.Module):
    def __init__(self, dtype=torch.float32, device=None):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.weight = set_meta(nn.Parameter(torch.randn(8, 4, generator=g).to(device, dtype)),
                               ParamMeta(name="weight"))
        self.bias = set_meta(nn.Parameter(torch.randn(8, generator=g).to(device, dtype)),
                             ParamMeta(name="bias", no_weight_decay=True))

    def forward(self, x):
        return nn.functional.linear(x, self.weight, self.bias).square().mean()


def _optimizer(model, clip=1.0, **precision):
    _, shard = whole(list(model.parameters()))
    cfg = OptimizerConfig(lr=0.01, weight_decay=0.1, clip_grad=clip)
    return MixedPrecisionOptimizer(shard, cfg, PrecisionConfig(**precision),
                                   norm_axes=[])


@pytest.mark.cuda
@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_fp32_matches_torch_adamw_with_clipping(clip):
    device = rank_device()
    ours, ref = Tiny(device=device), Tiny(device=device)
    opt = _optimizer(ours, clip=clip)
    ref_opt = torch.optim.AdamW([{"params": [ref.weight], "weight_decay": 0.1},
                                 {"params": [ref.bias], "weight_decay": 0.0}], lr=0.01)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        xs = [torch.randn(5, 4, generator=g).to(device) for _ in range(3)]
        opt.zero_grad()
        for x in xs:
            (ours(x) / 3).backward()
        stats = opt.step(lr=0.01)
        ref_opt.zero_grad()
        for x in xs:
            (ref(x) / 3).backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip if clip else float("inf"))
        ref_opt.step()
        torch.testing.assert_close(stats.grad_norm, norm, rtol=1e-6, atol=0)
    torch.testing.assert_close(ours.weight, ref.weight, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ours.bias, ref.bias, rtol=1e-6, atol=1e-7)


def test_fp32_gradients_accumulate_in_place_in_the_flat_buffer():
    model = Tiny()
    opt = _optimizer(model)
    assert opt.master is None  # fp32: the parameters are the master weights
    model(torch.ones(2, 4)).backward()
    assert model.weight.grad.data_ptr() == model.weight.main_grad.data_ptr()
    assert opt.shard.grads.abs().sum() > 0


def test_bf16_accumulates_micro_batch_gradients_in_fp32():
    """A large first gradient then many tiny ones: bf16 (8-bit mantissa) accumulation loses
    every tiny one, fp32 keeps them."""
    p = set_meta(nn.Parameter(torch.zeros((), dtype=torch.bfloat16)), ParamMeta(name="p"))
    buffers, _ = whole([p])
    tiny = 2.0 ** -10
    grads = [1.0] + [tiny] * 16
    for g in grads:
        (p * g).backward()
    assert p.grad is None  # the hook moved it into the fp32 buffer
    assert buffers.grads.item() == 1.0 + 16 * tiny
    bf16_sum = torch.zeros((), dtype=torch.bfloat16)
    for g in grads:
        bf16_sum += torch.tensor(g, dtype=torch.bfloat16)
    assert bf16_sum.item() == 1.0, "the case must be one that bf16 accumulation gets wrong"


def test_bf16_master_weights_are_fp32_and_copied_back():
    model = Tiny(torch.bfloat16)
    opt = _optimizer(model, bf16=True)
    assert opt.master.dtype == torch.float32 and model.weight.dtype == torch.bfloat16
    model(torch.ones(2, 4, dtype=torch.bfloat16)).backward()
    opt.step(lr=0.01)
    assert torch.equal(opt.shard.flat_params, opt.master.to(torch.bfloat16))
    assert opt.state_bytes() == 12 * (8 * 4 + 8)  # fp32 master + two fp32 moments


def test_fp16_overflow_skips_the_step_and_lowers_the_scale():
    model = Tiny(torch.float16)
    opt = _optimizer(model, fp16=True, initial_loss_scale=1024.0, hysteresis=1)
    before = opt.shard.flat_params.clone()
    master_before = opt.master.clone()
    opt.zero_grad()
    (model(torch.ones(2, 4, dtype=torch.float16)) * opt.loss_scale).backward()
    opt.shard.grads[3] = float("inf")  # an overflow in one gradient
    stats = opt.step(lr=0.01)
    assert stats.skipped.item() == 1.0 and stats.nan.item() == 0.0  # routine, not a NaN step
    assert torch.equal(opt.shard.flat_params, before) and torch.equal(opt.master, master_before)
    assert opt.loss_scale == 512.0
    opt.zero_grad()
    (model(torch.ones(2, 4, dtype=torch.float16)) * opt.loss_scale).backward()
    stats = opt.step(lr=0.01)
    assert stats.skipped.item() == 0.0 and not torch.equal(opt.shard.flat_params, before)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_grad_norm_skips_the_step_bitwise(dtype, bad):
    """The fused AdamW skips on the device (``found_inf``): nothing moves, Adam's step too."""
    device = rank_device()
    model = Tiny(dtype, device)
    opt = _optimizer(model, bf16=dtype == torch.bfloat16)
    x = torch.ones(2, 4, dtype=dtype, device=device)
    model(x).backward()
    opt.step(lr=0.01)
    before = {"params": opt.shard.flat_params.clone(), **opt.local_state()}
    opt.zero_grad()
    model(x).backward()
    opt.shard.grads[3] = bad
    stats = opt.step(lr=0.01)
    assert stats.skipped.item() == stats.nan.item() == 1.0
    after = {"params": opt.shard.flat_params, **opt.local_state()}
    for name, value in before.items():  # weights, fp32 master, moments, Adam's step
        assert torch.equal(after[name], value), name
    opt.zero_grad()
    model(x).backward()
    stats = opt.step(lr=0.01)
    assert stats.skipped.item() == 0.0 and opt.local_state()["step"].item() == 2.0
    assert not torch.equal(opt.shard.flat_params, before["params"])


def test_fp16_unscales_gradients_before_the_update():
    model, ref = Tiny(torch.float16), Tiny(torch.float16)
    scaled = _optimizer(model, fp16=True, loss_scale=256.0, clip=0.0)
    unscaled = _optimizer(ref, fp16=True, loss_scale=1.0, clip=0.0)
    x = torch.ones(2, 4, dtype=torch.float16)
    (model(x) * 256.0).backward()
    ref(x).backward()
    a, b = scaled.step(0.01), unscaled.step(0.01)
    torch.testing.assert_close(a.grad_norm, b.grad_norm, rtol=1e-3, atol=0)
    assert torch.equal(scaled.shard.flat_params, unscaled.shard.flat_params)
