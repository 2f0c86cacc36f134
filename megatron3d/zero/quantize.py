"""Quantized collectives: ZeRO-3's weight all-gather and gradient reduce-scatter in int8.

Blockwise symmetric int8 (ZeRO++'s scheme): each block of ``block`` (256) consecutive
elements of a chunk has one fp32 scale, ``absmax / 127``, and each element travels as
``q = clamp(round(x / scale), -127, 127)``, decoded as ``q * scale``. Per element, in fp32::

    |x - q * scale| <= absmax / 254 * (1 + 2**-14) + 2**-143

``absmax`` being the largest magnitude in the element's block; the factor and the second term
are fp32's own rounding (the second matters only where the scale is subnormal, absmax <
2**-119). An all-zero block decodes to zeros, and a block holding an inf or NaN decodes to
non-finite values only (its scale is non-finite), so an overflow still reaches the loss
scaler. Decoding into a narrower ``out`` (bf16) rounds the fp32 result once more.

On the wire every rank's chunk is one record of bytes: its fp32 scales, then its int8
values, padded to a multiple of 4 bytes: 1/4 + 1/block of the fp32 bytes (0.254x at 256).
So each quantized collective is ONE collective of bytes, through ``mpu/comm`` (its
observers count what each rank sends). The buffers are a ``QuantizedWire``'s, allocated once;
a call allocates nothing beyond views, and nothing waits on the host: the decoding is queued
after the collective (on CUDA, on the compute stream ``wait`` orders after it).
"""

from __future__ import annotations

import math

import torch

from megatron3d.mpu import comm
from megatron3d.mpu.state import AxisGroup

_QMAX = 127


class QuantizedWire:
    """The scratch of quantized collectives over an axis of ``axis_size`` ranks for tensors
    of up to ``max_numel`` elements (a gathered ``out``, a reduce-scattered ``t``): the bytes
    sent and received, and an fp32 chunk to quantize a gather's input in. One collective in
    flight per wire."""

    def __init__(self, max_numel: int, axis_size: int, device: torch.device,
                 block: int = 256) -> None:
        if block < 1 or axis_size < 1:
            raise ValueError(f"QuantizedWire: block {block} and axis size {axis_size} must "
                             "be positive")
        self.block, self.axis_size = block, axis_size
        self.max_chunk = math.ceil(max_numel / axis_size)
        size = axis_size * self.record_bytes(self.max_chunk)
        self.sent = torch.zeros(size, dtype=torch.uint8, device=device)
        self.received = torch.zeros(size, dtype=torch.uint8, device=device)
        self.chunk = torch.zeros(self.max_chunk, dtype=torch.float32, device=device)

    def record_bytes(self, numel: int) -> int:
        """Bytes one rank's chunk of ``numel`` elements takes on the wire."""
        blocks = math.ceil(numel / self.block)
        return (4 * blocks + numel + 3) // 4 * 4

    def check(self, numel: int, axis_size: int) -> None:
        """Raise unless a tensor of ``numel`` elements over ``axis_size`` ranks fits."""
        if axis_size != self.axis_size or numel > self.axis_size * self.max_chunk:
            raise ValueError(f"a quantized collective of {numel} elements over {axis_size} "
                             f"ranks does not fit its wire ({self.axis_size * self.max_chunk} "
                             f"over {self.axis_size}): size the QuantizedWire for it")

    def records(self, buf: torch.Tensor, rows: int, numel: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of ``rows`` records of ``numel`` elements at the start of ``buf``: the
        scales fp32 [rows, blocks] and the values int8 [rows, numel]."""
        blocks = math.ceil(numel / self.block)
        recs = buf[:rows * self.record_bytes(numel)].view(rows, -1)  # [rows, record bytes]
        scales = recs[:, :4 * blocks].view(torch.float32)
        return scales, recs[:, 4 * blocks:4 * blocks + numel].view(torch.int8)


def encode(x: torch.Tensor, scales: torch.Tensor, q: torch.Tensor, block: int) -> None:
    """Quantize the rows of fp32 ``x`` [rows, n] (overwritten: it is scratch) into int8
    ``q`` [rows, n] and their blocks' scales ``scales`` fp32 [rows, ceil(n / block)]."""
    inf = float("inf")
    for xs, ss in _blocks(x, scales, block):  # ss [rows, blocks, 1]: the absmax, then scale
        torch.linalg.vector_norm(xs, ord=inf, dim=2, keepdim=True, out=ss)
        ss.div_(_QMAX)
        xs.div_(ss)
    # A zero scale made 0/0 or x/0: such a block held only zeros or the tiniest subnormals,
    # and decodes to 0 whatever q is; a non-finite scale decodes non-finite whatever q is.
    x.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0).round_().clamp_(-_QMAX, _QMAX)
    q.copy_(x)


def decode(q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, block: int) -> None:
    """``out`` [rows, n] (any float dtype) = int8 ``q`` [rows, n] times its blocks' fp32
    ``scales`` [rows, ceil(n / block)], computed in fp32."""
    for (qs, ss), (os, _) in zip(_blocks(q, scales, block), _blocks(out, scales, block),
                                 strict=True):
        torch.mul(qs, ss, out=os)


def _blocks(x: torch.Tensor, scales: torch.Tensor, block: int
            ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``x`` [rows, n] as whole blocks [rows, n // block, block] and, when ``block`` does
    not divide n, the short last one [rows, 1, rest]; each with its scales [.., .., 1]."""
    n = x.shape[1]
    whole = n // block * block
    parts = []
    if whole:
        parts.append((x[:, :whole].unflatten(1, (whole // block, block)),
                      scales[:, :whole // block].unsqueeze(2)))
    if whole < n:
        parts.append((x[:, whole:].unsqueeze(1), scales[:, whole // block:].unsqueeze(2)))
    return parts


def quantize(x: torch.Tensor, block: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat ``x`` (any float dtype) as int8 values and fp32 block scales (new tensors; for
    tests and offline use, the collectives encode into their wire)."""
    scales = torch.empty(1, math.ceil(x.numel() / block), device=x.device)
    q = torch.empty(1, x.numel(), dtype=torch.int8, device=x.device)
    encode(x.reshape(1, -1).float().clone(), scales, q, block)
    return q.view(-1), scales.view(-1)


def dequantize(q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor,
               block: int = 256) -> torch.Tensor:
    """Decode flat ``q`` and its ``scales`` into flat ``out`` (any float dtype); returns it."""
    decode(q.view(1, -1), scales.view(1, -1), out.view(1, -1), block)
    return out


def start_all_gather(out: torch.Tensor, mine: torch.Tensor, axis: AxisGroup,
                     wire: QuantizedWire, tag: object = None) -> comm.Work | None:
    """Begin gathering every rank's flat ``mine`` into ``out`` [axis.size * mine.numel()]
    through int8: ``wait()`` on the returned work decodes every chunk, this rank's too, so
    every rank holds the same values (within the module's bound of the originals). ``mine``
    may be this rank's chunk of ``out``. None: done (a size-1 axis copies exactly)."""
    n = mine.numel()
    if axis.size == 1:
        if out.data_ptr() != mine.data_ptr():
            out.copy_(mine)
        return None
    wire.check(out.numel(), axis.size)
    if out.numel() != axis.size * n:
        raise ValueError(f"all-gather of {n} elements per rank into {out.numel()}: out needs "
                         f"{axis.size * n}")
    x = wire.chunk[:n].view(1, n)
    x.copy_(mine.view(1, n))
    scales, q = wire.records(wire.sent, 1, n)
    encode(x, scales, q, wire.block)
    record = wire.record_bytes(n)
    work = comm.start_all_gather_into(wire.received[:axis.size * record], wire.sent[:record],
                                      axis, tag, least_bytes=True)
    got_scales, got_q = wire.records(wire.received, axis.size, n)
    return comm.Then(work, lambda: decode(got_q, got_scales, out.view(axis.size, n), wire.block))


def start_reduce_scatter(out: torch.Tensor, t: torch.Tensor, axis: AxisGroup,
                         wire: QuantizedWire, tag: object = None) -> comm.Work | None:
    """Begin summing chunk ``axis.rank`` of every rank's flat fp32 ``t`` into fp32 ``out``
    [t.numel() // axis.size]: the other chunks travel as int8 in one all-to-all, this rank's
    own is added exactly, in fp32, in rank order (deterministic). ``t`` is the caller's
    scratch (overwritten); ``out`` may be this rank's own chunk of it. ``wait()`` finishes."""
    if axis.size == 1:
        if out.data_ptr() != t.data_ptr():
            out.copy_(t)
        return None
    wire.check(t.numel(), axis.size)
    n = t.numel() // axis.size
    if t.dtype != torch.float32 or out.dtype != torch.float32 or out.numel() * axis.size != \
            t.numel():
        raise ValueError(f"quantized reduce-scatter: t fp32 [{axis.size} * n] into out fp32 "
                         f"[n]; got {t.dtype} [{t.numel()}] into {out.dtype} [{out.numel()}]")
    rows, me = t.view(axis.size, n), axis.rank
    scales, q = wire.records(wire.sent, axis.size, n)
    for lo, hi in ((0, me), (me + 1, axis.size)):  # every chunk but this rank's own
        if lo < hi:
            encode(rows[lo:hi], scales[lo:hi], q[lo:hi], wire.block)
    size = axis.size * wire.record_bytes(n)
    work = comm.start_all_to_all_into(wire.received[:size], wire.sent[:size], axis, tag)
    return comm.Then(work, lambda: _sum_in_rank_order(out, rows, me, wire))


def _sum_in_rank_order(out: torch.Tensor, rows: torch.Tensor, me: int,
                       wire: QuantizedWire) -> None:
    """``out`` = rows[0] + rows[1] + ... (fp32, left to right), row ``me`` being this rank's
    exact chunk and the others the decoded chunks received (decoded into ``rows``)."""
    size, n = rows.shape
    scales, q = wire.records(wire.received, size, n)
    for lo, hi in ((0, me), (me + 1, size)):
        if lo < hi:
            decode(q[lo:hi], scales[lo:hi], rows[lo:hi], wire.block)
    for r in range(1, me):  # the prefix before this rank, summed in place
        rows[r].add_(rows[r - 1])
    if out.data_ptr() != rows[me].data_ptr():
        out.copy_(rows[me])
    if me > 0:
        out.add_(rows[me - 1])  # own + prefix: the same bits as prefix + own
    for r in range(me + 1, size):
        out.add_(rows[r])

