"""Blockwise int8 quantization (``zero/quantize.py``): the stated error bound on adversarial
blocks, and the quantized all-gather and reduce-scatter on 2 and 4 gloo ranks, bitwise equal
to the pure helpers applied chunk by chunk, with a quarter of fp32's bytes on the wire."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from megatron3d.mpu import comm, traffic
from megatron3d.mpu.state import AxisGroup
from megatron3d.zero import quantize as qz
from tests.helpers.dist import run_distributed

BLOCK = 256


def _bound(x: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """The documented per-element bound, from each element's block absmax (fp64)."""
    x = x.double().reshape(-1)
    pad = (-x.numel()) % block
    absmax = torch.nn.functional.pad(x.abs(), (0, pad)).view(-1, block).amax(1)
    per_elem = absmax.repeat_interleave(block)[:x.numel()]
    return per_elem / 254 * (1 + 2.0 ** -14) + 2.0 ** -143


def _adversarial(gen: torch.Generator, n_tail: int = 37) -> torch.Tensor:
    """Blocks built to break a careless quantizer, then a short tail block (fp32)."""
    normal = torch.randn(BLOCK, generator=gen)
    outlier = torch.randn(BLOCK, generator=gen) * 1e-3
    outlier[17] = -3e30  # one huge value: the rest round to 0, within the bound
    zeros = torch.zeros(BLOCK)
    tiny = torch.randn(BLOCK, generator=gen) * 1e-40  # subnormal values and scale
    smallest = torch.tensor([2.0 ** -149, -2.0 ** -149, 0.0] * 86)[:BLOCK]  # scale rounds to 0
    mixed = torch.randn(BLOCK, generator=gen).sign() * torch.rand(BLOCK, generator=gen) * 1e4
    grid = torch.arange(-127.0, 129.0).clamp(max=127) * 0.5  # on the grid of scale 0.5
    tail = torch.randn(n_tail, generator=gen) * 7
    return torch.cat([normal, outlier, zeros, tiny, smallest, mixed, grid, tail])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_error_within_stated_bound(dtype: torch.dtype) -> None:
    x = _adversarial(torch.Generator().manual_seed(0)).to(dtype)
    q, scales = qz.quantize(x)
    assert q.dtype == torch.int8 and q.numel() == x.numel()
    assert scales.dtype == torch.float32 and scales.numel() == math.ceil(x.numel() / BLOCK)
    deq = qz.dequantize(q, scales, torch.empty(x.numel()))
    assert torch.isfinite(deq).all()
    err = (x.double() - deq.double()).abs()
    assert (err <= _bound(x)).all(), f"worst excess {(err - _bound(x)).max()}"
    assert torch.equal(deq[2 * BLOCK:3 * BLOCK], torch.zeros(BLOCK))  # zero block: zeros
    assert torch.equal(deq[6 * BLOCK:7 * BLOCK], x[6 * BLOCK:7 * BLOCK].float())  # on grid
    assert (q.abs() <= 127).all()
    zero_scale = (scales == 0).repeat_interleave(BLOCK)[:x.numel()]
    assert zero_scale.sum() == 2 * BLOCK and not q[zero_scale].any()  # zeros on the wire


def test_dequantize_into_bf16_rounds_once() -> None:
    x = _adversarial(torch.Generator().manual_seed(1))
    q, scales = qz.quantize(x)
    deq32 = qz.dequantize(q, scales, torch.empty(x.numel()))
    deq16 = qz.dequantize(q, scales, torch.empty(x.numel(), dtype=torch.bfloat16))
    assert torch.equal(deq16, deq32.to(torch.bfloat16))


def test_non_finite_block_stays_non_finite() -> None:
    """An overflowed gradient must still be seen by the loss scaler after quantization."""
    x = torch.randn(3 * BLOCK)
    x[5], x[BLOCK + 9] = float("inf"), float("nan")
    q, scales = qz.quantize(x)
    deq = qz.dequantize(q, scales, torch.empty(x.numel()))
    assert not torch.isfinite(deq[:2 * BLOCK]).any()
    assert (deq[2 * BLOCK:] - x[2 * BLOCK:]).abs().le(_bound(x[2 * BLOCK:])).all()


def test_wire_capacity() -> None:
    wire = qz.QuantizedWire(1000, 4, torch.device("cpu"))
    with pytest.raises(ValueError, match="1004"):
        wire.check(1004, 4)
    wire.check(1000, 4)


def _chunks(rank: int, size: int, n: int) -> torch.Tensor:
    """What rank ``rank`` contributes: ``size`` chunks of ``n`` adversarial values."""
    gen = torch.Generator().manual_seed(100 + rank)
    parts = [_adversarial(gen)[i % 5 * BLOCK:][:n] * (1 + rank) for i in range(size)]
    return torch.cat(parts)


def _collectives(n: int) -> dict:
    """Each collective on the world axis, fp32 and quantized, its bytes counted."""
    rank, size = dist.get_rank(), dist.get_world_size()
    axis = AxisGroup(dist.group.WORLD, rank, size, tuple(range(size)), "dp")
    wire = qz.QuantizedWire(size * n, size, torch.device("cpu"))
    t = _chunks(rank, size, n)
    mine = t[:n].clone()
    found: dict = {}
    counter = traffic.CommCounter()
    with traffic.observing(counter):
        for dtype in (torch.float32, torch.bfloat16):
            out = torch.full((size * n,), float("nan"), dtype=dtype)
            qz.start_all_gather(out, mine.to(dtype), axis, wire, tag="g").wait()
            found[("gather", dtype)] = out
        out = torch.full((n,), float("nan"))
        qz.start_reduce_scatter(out, t.clone(), axis, wire).wait()
        found["reduce"] = out
        scratch = t.clone()
        own = scratch[rank * n:(rank + 1) * n]
        qz.start_reduce_scatter(own, scratch, axis, wire).wait()  # in place, as ZeRO-3 does
        found["reduce in place"] = own.clone()
        found["quantized bytes"] = dict(counter.bytes)
        counter.reset()
        comm.start_all_gather_into(torch.empty(size * n), mine, axis).wait()
        comm.start_reduce_scatter(torch.empty(n), t.clone(), axis).wait()
        found["fp32 bytes"] = dict(counter.bytes)
    return found


@pytest.mark.parametrize("size", [2, 4])
def test_collectives_match_the_helpers_chunk_by_chunk(size: int) -> None:
    n = 600  # three blocks per chunk, the last one short
    results = run_distributed(_collectives, size, n)
    inputs = [_chunks(r, size, n) for r in range(size)]

    def deq(x: torch.Tensor) -> torch.Tensor:
        return qz.dequantize(*qz.quantize(x), torch.empty(x.numel()))

    gathered = torch.cat([deq(inputs[r][:n]) for r in range(size)])
    originals = torch.cat([inputs[r][:n] for r in range(size)])
    halves = torch.cat([deq(inputs[r][:n].bfloat16()) for r in range(size)]).bfloat16()
    for found in results:  # identical on every rank, own chunk too
        assert torch.equal(found[("gather", torch.float32)], gathered)
        assert torch.equal(found[("gather", torch.bfloat16)], halves)
    bounds = torch.cat([_bound(inputs[r][:n]) for r in range(size)])  # blocks per chunk
    assert ((gathered.double() - originals.double()).abs() <= bounds).all()
    for me, found in enumerate(results):
        parts = [inputs[r][me * n:(me + 1) * n] for r in range(size)]
        expect = parts[0] if me == 0 else deq(parts[0])
        for r in range(1, size):  # fp32, in rank order, this rank's own chunk exact
            expect = expect + (parts[r] if r == me else deq(parts[r]))
        assert torch.equal(found["reduce"], expect)
        assert torch.equal(found["reduce in place"], expect)
        exact = sum(p.double() for p in parts)
        bound = sum(_bound(p) for r, p in enumerate(parts) if r != me)
        rounding = size * 2.0 ** -24 * sum(p.double().abs() for p in parts)
        assert ((found["reduce"].double() - exact).abs() <= bound + rounding).all()
        quantized, fp32 = found["quantized bytes"], found["fp32 bytes"]
        assert set(quantized) == {"all_gather", "all_to_all"}
        record = 4 * 3 + n  # three fp32 scales, then the int8 values
        assert quantized["all_gather"] == 2 * record
        assert quantized["all_to_all"] == 2 * size * record
        ratio = quantized["all_to_all"] / 2 / fp32["reduce_scatter"]
        assert 0.25 <= ratio <= 0.26, ratio
        assert 0.25 <= quantized["all_gather"] / 2 / fp32["all_gather"] <= 0.26
