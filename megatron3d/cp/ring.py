"""The ring (``--cp-comm-type p2p``): keys and values travel around the CP group, one rank's
shard per step, while each rank attends its queries to the shard in hand.

Rank r holds chunks r and 2C-1-r of the 2C-chunk layout (``layout.py``), in that order, so
its tokens are in sequence order and, against the shard of rank j, the causal mask leaves:
- j = r: the shard's own causal square (a lower triangle over both chunks);
- j < r: all of its queries against j's early chunk (j's late chunk lies after them all);
- j > r: its late chunk's queries against all of j's keys (its early chunk precedes them).
Every step after the first is thus half a block, the same on every rank; the fully hidden
halves are skipped without looking at the tensors (no host sync). With documents or ALiBi
each block also gets its explicit mask from the tokens (``masks.py``), so a query sees
exactly the keys ``visible`` gives. This relies on ``info.index`` following the layout, as
every producer of TokenInfo under CP does (``layout.shard``, ``layout.rank_index``).

Forward: step t attends to the shard of rank (r - t) mod C while the next one is already
being received (``comm.start_exchange``, posted before the block's compute), and merges
the block's (out, lse) in fp32 (``block.merge_``). Backward runs the ring again: each
block's probabilities come back from the final lse, dQ accumulates here; the own shard's
fp32 dK/dV stay here, the other shards' travel with them and reach their owner one step
after the last (C - 1 transfers of dK/dV, not C).
"""

from __future__ import annotations

import torch

from megatron3d.cp import block
from megatron3d.cp.masks import additive_mask, gather_info, take
from megatron3d.cp.tokens import TokenInfo
from megatron3d.mpu import comm
from megatron3d.mpu.state import AxisGroup

_ALL = slice(None)


class _Ring:
    """What a ring pass needs besides the tensors: the group, the tokens and ALiBi."""

    def __init__(self, cp: AxisGroup, info: TokenInfo, slopes: torch.Tensor | None,
                 batch: int) -> None:
        self.cp, self.info, self.slopes, self.batch = cp, info, slopes, batch
        self.explicit = not info.plain_causal or slopes is not None
        # Documents, positions or ALiBi need every shard's tokens (small int64 tensors).
        self.keys = gather_info(info, cp) if self.explicit else info
        self.local = len(info.index)

    def source(self, step: int) -> int:
        """The CP rank whose keys and values this rank holds at ``step``."""
        return (self.cp.rank - step) % self.cp.size

    def parts(self, source: int) -> tuple[slice, slice]:
        """The query rows and key columns that may see each other against ``source``."""
        half = self.local // 2
        if source == self.cp.rank:
            return _ALL, _ALL
        return (_ALL, slice(0, half)) if source < self.cp.rank else (slice(half, None), _ALL)

    def mask(self, source: int, rows: slice, cols: slice,
             dtype: torch.dtype) -> tuple[torch.Tensor | None, bool]:
        """(additive mask or None, causal) of one block. The own shard's block is causal
        even under its mask, which lets the kernel skip the half above the diagonal."""
        causal = source == self.cp.rank
        if not self.explicit:
            return None, causal
        start = source * self.local
        keys = take(self.keys, slice(start, start + self.local))
        return additive_mask(take(self.info, rows), take(keys, cols), self.batch,
                             self.slopes, dtype), causal

    def begin(self, step: int, kv: torch.Tensor, dtype: torch.dtype) -> tuple:
        """(next shard's buffer, its works, (rows, cols, mask, causal) of the block in hand):
        the next exchange posted first (none after the last step: the buffer is ``kv``)."""
        received, works = self.pass_on(kv) if step + 1 < self.cp.size else (kv, [])
        source = self.source(step)
        rows, cols = self.parts(source)
        return received, works, (rows, cols, *self.mask(source, rows, cols, dtype))

    def pass_on(self, t: torch.Tensor) -> tuple[torch.Tensor, list[comm.Work]]:
        """Post sending ``t`` to the next rank and receiving the previous rank's into a new
        buffer; returns the buffer and the works (wait them all before reading it)."""
        cp = self.cp
        buffer = torch.empty_like(t)
        works = comm.start_exchange([(t, (cp.rank + 1) % cp.size)],
                                    [(buffer, (cp.rank - 1) % cp.size)], cp)
        return buffer, works


def _wait(works: list[comm.Work]) -> None:
    for work in works:
        work.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                ring: _Ring) -> torch.Tensor:
        kv = torch.stack((k, v))  # one message per step: [2, b, G, s, d]
        out = lse = None
        for step in range(ring.cp.size):
            received, works, (rows, cols, bias, causal) = ring.begin(step, kv, q.dtype)
            part_out, part_lse = block.forward(q[:, :, rows], kv[0][:, :, cols],
                                               kv[1][:, :, cols], bias, causal)
            if out is None:  # the own shard, first: every query sees itself there
                out, lse = part_out.float(), part_lse
            else:
                block.merge_(out[:, :, rows], lse[:, :, rows], part_out, part_lse)
            _wait(works)
            kv = received
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        q, k, v, out, lse = ctx.saved_tensors
        ring: _Ring = ctx.ring
        kv = torch.stack((k, v))
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        own = None  # the own shard's dK/dV: they never travel
        dkv = dkv_works = None  # the dK/dV travelling with the shard in hand
        for step in range(ring.cp.size):
            received, works, (rows, cols, bias, causal) = ring.begin(step, kv, q.dtype)
            dq_part, dk_part, dv_part = block.backward(
                grad[:, :, rows], q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols],
                out[:, :, rows], lse[:, :, rows], bias, causal)
            dq[:, :, rows] += dq_part
            if step == 0:
                own = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
                own[0][:, :, cols] += dk_part
                own[1][:, :, cols] += dv_part
            else:
                if dkv is None:  # step 1 starts the sum for the shard in hand
                    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
                else:
                    _wait(dkv_works)
                dkv[0][:, :, cols] += dk_part
                dkv[1][:, :, cols] += dv_part
                dkv, dkv_works = ring.pass_on(dkv)  # on; after the last step, to its owner
            _wait(works)
            kv = received
        _wait(dkv_works)  # this rank's shard's sum from the other ranks, C - 1 hops later
        own += dkv
        return dq.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype), None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, info: TokenInfo,
                   cp: AxisGroup, slopes: torch.Tensor | None) -> torch.Tensor:
    """q [b, n, s_local, d], k and v [b, G, s_local, d] -> [b, n, s_local, d], over a CP
    group of 2 or more ranks (see the module docstring)."""
    return _RingAttention.apply(q, k, v, _Ring(cp, info, slopes, q.shape[0]))
