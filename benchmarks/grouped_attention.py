"""Grouped-query attention with shared keys and values against copies per query head.

For fp32 and bf16, causal and ALiBi attention, attention dropout 0 and 0.1, on this machine's
device (CUDA where there is one): which way ``model/grouped_attention.py`` shares the keys
and values, the SDPA kernel each side runs, the bytes autograd keeps for backward, whether
the output and query gradient are bitwise those of the copies (and the largest key and value
gradient differences), and the forward + backward time, shared / copied, each the median
of ``--repeats``. q, k and v are permuted views of one [s, b, G, n/G + 2, d] tensor, as the
model makes them.

    python -m benchmarks.grouped_attention
    python -m benchmarks.grouped_attention --heads 32 --groups 8 --seq 2048 --head-dim 128
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from unittest import mock

import torch

from megatron3d import device as devices
from megatron3d.accounting.activations import saved_bytes
from megatron3d.model import grouped_attention
from megatron3d.model.grouped_attention import Path, attention, grouped_path
from megatron3d.model.positional import alibi_causal_bias, alibi_slopes


def _inputs(a: argparse.Namespace, dtype: torch.dtype, alibi: bool,
            dev: torch.device) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(0)
    size = a.heads // a.groups
    qkv = torch.randn(a.seq, a.batch, a.groups, size + 2, a.head_dim, generator=gen)
    q, k, v = qkv.to(dev, dtype).split([size, 1, 1], dim=3)
    q = q.reshape(a.seq, a.batch, a.heads, a.head_dim).permute(1, 2, 0, 3)
    k, v = (t.squeeze(3).permute(1, 2, 0, 3) for t in (k, v))
    grad = torch.randn(a.batch, a.heads, a.seq, a.head_dim, generator=gen).to(dev, dtype)
    bias = alibi_causal_bias(alibi_slopes(a.heads), a.seq, dtype, dev) if alibi else None
    return [q, k, v], grad, bias


def _kernels(inputs: list[torch.Tensor], bias: torch.Tensor | None, p: float) -> str:
    """The SDPA kernels one forward runs, as the profiler names them."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        attention(*inputs, bias, p)
    names = {e.key.removeprefix("aten::_scaled_dot_product_") for e in prof.key_averages()}
    return ", ".join(sorted(n for n in names if not n.startswith("aten::")))


def _step(inputs: list[torch.Tensor], grad: torch.Tensor, bias: torch.Tensor | None,
          p: float) -> tuple[int, list[torch.Tensor]]:
    q, k, v = (t.detach().clone().requires_grad_() for t in inputs)
    torch.manual_seed(5)
    size, out = saved_bytes(lambda: attention(q, k, v, bias, p))
    out.backward(grad)
    return size, [out.detach(), q.grad, k.grad, v.grad]


def _median_ms(inputs: list[torch.Tensor], grad: torch.Tensor, bias: torch.Tensor | None,
               p: float, dev: torch.device, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):  # the first warms up
        devices.synchronize(dev)
        start = time.perf_counter()
        _step(inputs, grad, bias, p)
        devices.synchronize(dev)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[1:])


def _side(a: argparse.Namespace, inputs: list[torch.Tensor], grad: torch.Tensor,
          bias: torch.Tensor | None, p: float, dev: torch.device,
          copied: bool) -> tuple[str, int, list[torch.Tensor], float]:
    """(kernels, saved bytes, [out, dq, dk, dv], median ms) shared, or copied per head."""
    forced = (mock.patch.object(grouped_attention, "grouped_path", lambda *args: Path.COPY)
              if copied else contextlib.nullcontext())
    with forced:
        size, result = _step(inputs, grad, bias, p)
        ms = _median_ms(inputs, grad, bias, p, dev, a.repeats)
        return _kernels(inputs, bias, p), size, result, ms


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    dev = devices.device()
    out = sys.stdout
    out.write(f"{devices.describe(dev)}; b {a.batch}, {a.heads} heads in {a.groups} groups, "
              f"s {a.seq}, d {a.head_dim}\n")
    out.write("| dtype | mask | dropout | path | kernel: shared / copied | saved: shared / "
              "copied | out, dq bitwise | max dk, dv diff | ms: shared / copied |\n")
    out.write("| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n")
    for dtype in (torch.float32, torch.bfloat16):
        for alibi in (False, True):
            for drop in (0.0, 0.1):
                inputs, grad, bias = _inputs(a, dtype, alibi, dev)
                path = grouped_path(*inputs, bias, drop)
                kernel, size, got, ms = _side(a, inputs, grad, bias, drop, dev, False)
                kernel_c, size_c, ref, ms_c = _side(a, inputs, grad, bias, drop, dev, True)
                same = all(torch.equal(x, y) for x, y in zip(got[:2], ref[:2], strict=True))
                diff = ", ".join(f"{(x.float() - y.float()).abs().max().item():.1e}"
                                 for x, y in zip(got[2:], ref[2:], strict=True))
                out.write(f"| {str(dtype)[6:]} | {'alibi' if alibi else 'causal'} | {drop} | "
                          f"{path.name.lower()} | {kernel} / {kernel_c} | {size:,} / "
                          f"{size_c:,} ({size / size_c:.2f}) | {same} | {diff} | "
                          f"{ms:.2f} / {ms_c:.2f} ({ms / ms_c:.2f}) |\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
