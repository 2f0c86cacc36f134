"""Each context-parallel exchange against torch SDPA over the whole sequence in one process
(the independent implementation): the output and the q, k, v gradients, at CP 2 and 4, for
plain causal attention, GQA, ALiBi and packed documents.

One spawn per (C, exchange) runs every case; the reference mask and ALiBi bias are built
here from the full sequence, not with ``cp/``'s helpers.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from megatron3d.cp import block
from megatron3d.cp.attention import context_attention
from megatron3d.cp.layout import rank_index, shard
from megatron3d.cp.tokens import TokenInfo
from megatron3d.mpu import comm, traffic
from megatron3d.mpu.state import ParallelState
from tests.helpers.dist import run_distributed
from tests.helpers.tolerances import FP32

B, S, D = 2, 32, 8
DOC_LENGTHS = ([5, 13, 9, 5], [20, 12])  # documents that cross chunk boundaries
CASES = {  # name: (query heads, query groups, ALiBi, packed documents)
    "causal": (4, 4, False, False),
    "gqa": (4, 2, False, False),
    "mqa": (4, 1, False, False),
    "gqa_8_4": (8, 4, False, False),
    "alibi": (8, 4, True, False),
    "documents": (8, 4, False, True),
    "documents_alibi": (4, 2, True, True),
}


def _a2a_splits(n: int, g: int, cp_size: int) -> bool:
    """Whether a2a can share the heads and query groups out (else refused by validation)."""
    return n % cp_size == 0 and g % cp_size == 0


def _documents() -> tuple[torch.Tensor, torch.Tensor]:
    """doc_ids and position_ids [B, S], positions restarting at each document."""
    docs = torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row))
                        for row in DOC_LENGTHS])
    starts = torch.stack([torch.repeat_interleave(torch.tensor([0, *row[:-1]]).cumsum(0),
                                                  torch.tensor(row)) for row in DOC_LENGTHS])
    return docs, torch.arange(S) - starts


def _inputs(n: int, g: int, alibi: bool, documents: bool) -> dict:
    gen = torch.Generator().manual_seed(n * 100 + g * 10 + 2 * alibi + documents)
    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)
    docs, pos = _documents() if documents else (None, None)
    return dict(q=draw(B, n, S, D), k=draw(B, g, S, D), v=draw(B, g, S, D),
                grad=draw(B, n, S, D), docs=docs, pos=pos,
                slopes=2.0 ** -torch.linspace(0.5, 8, n) if alibi else None)


def _reference(x: dict) -> list[torch.Tensor]:
    """Output and q, k, v gradients of SDPA over the whole sequence."""
    q, k, v = (x[name].clone().requires_grad_() for name in "qkv")
    i = torch.arange(S)
    allowed = (i.view(1, 1, S, 1) >= i.view(1, 1, 1, S)).expand(B, 1, S, S)
    if x["docs"] is not None:
        allowed = allowed & (x["docs"][:, None, :, None] == x["docs"][:, None, None, :])
    mask = allowed
    if x["slopes"] is not None:
        pos = x["pos"] if x["pos"] is not None else i.expand(B, S)
        distance = (pos[:, None, None, :] - pos[:, None, :, None]).float()
        mask = (x["slopes"].view(1, -1, 1, 1) * distance).masked_fill(~allowed, float("-inf"))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                         enable_gqa=k.shape[1] != q.shape[1])
    out.backward(x["grad"])
    return [out.detach(), q.grad, k.grad, v.grad]


def _parallel(x: dict, state: ParallelState, comm_type: str) -> list[torch.Tensor]:
    """This rank's shard of the output and gradients, through ``context_attention``."""
    c, r = state.cp.size, state.cp.rank
    q, k, v = (shard(x[name], 2, c, r).requires_grad_() for name in "qkv")
    info = TokenInfo(index=rank_index(S, c, r),
                     position_ids=None if x["pos"] is None else shard(x["pos"], 1, c, r),
                     doc_ids=None if x["docs"] is None else shard(x["docs"], 1, c, r))
    out = context_attention(q, k, v, info, state.cp, x["slopes"], 0.0, comm_type)
    out.backward(shard(x["grad"], 2, c, r))
    return [out.detach(), q.grad, k.grad, v.grad]


def _ring_events(x: dict, state: ParallelState) -> list[str]:
    """The ring's transfers and blocks in the order it posts and runs them."""
    events: list[str] = []
    def record(kind: str, *_: object) -> None:
        events.append(kind)
    def timed(real: object) -> object:
        return lambda *args: events.append("block") or real(*args)
    with traffic.observing(record), mock.patch.object(block, "forward", timed(block.forward)), \
            mock.patch.object(block, "backward", timed(block.backward)):
        _parallel(x, state, "p2p")
    return events


def _worker(cp_size: int, comm_type: str) -> dict:
    state = ParallelState.build(1, 1, cp_size=cp_size)
    results = {}
    for name, (n, g, alibi, documents) in CASES.items():
        if comm_type == "a2a" and not _a2a_splits(n, g, cp_size):
            continue
        x = _inputs(n, g, alibi, documents)
        want = [shard(t, 2, cp_size, state.cp.rank) for t in _reference(x)]
        results[name] = (_parallel(x, state, comm_type), want)
        if name == "causal" and comm_type == "a2a":  # gloo's all-to-all of device tensors
            with mock.patch.object(comm, "_gloo_on_device", return_value=True):
                results["causal_device_path"] = (_parallel(x, state, comm_type), want)
    if comm_type == "p2p":
        results["events"] = _ring_events(_inputs(*CASES["causal"]), state)
    return results


def _ring_order(cp_size: int) -> list[str]:
    """Forward: each step's exchange posted before its block; backward likewise, then, after
    every block but the own shard's (whose dK/dV stay), the dK/dV passed on (the last to
    their owner)."""
    step = ["send", "recv", "block"]
    forward = step * (cp_size - 1) + ["block"]
    backward = step + (step + ["send", "recv"]) * (cp_size - 2) + ["block", "send", "recv"]
    return forward + backward


@pytest.mark.parametrize("cp_size", [2, 4])
@pytest.mark.parametrize("comm_type", ["p2p", "all_gather", "a2a"])
def test_exchange_matches_sdpa_over_the_whole_sequence(cp_size: int, comm_type: str) -> None:
    ranks = run_distributed(_worker, cp_size, cp_size, comm_type)
    expected = {name for name, (n, g, *_) in CASES.items()
                if comm_type != "a2a" or _a2a_splits(n, g, cp_size)}
    expected |= {"a2a": {"causal_device_path"}, "p2p": {"events"}}.get(comm_type, set())
    for rank, results in enumerate(ranks):
        assert set(results) == expected
        if comm_type == "p2p":
            assert results.pop("events") == _ring_order(cp_size)
        for name, (got, want) in results.items():
            for what, a, b in zip(("output", "dq", "dk", "dv"), got, want, strict=True):
                torch.testing.assert_close(a, b, **FP32,
                                           msg=lambda m, w=what, n=name, r=rank:
                                           f"{n} {w} rank {r}: {m}")
