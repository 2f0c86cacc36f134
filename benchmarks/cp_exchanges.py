"""Forward + backward time of each context-parallel exchange (``cp/``) on C gloo ranks.

Each rank holds s/C tokens of one causal attention (the 2C-chunk layout) and runs
``context_attention`` with each ``--cp-comm-type``, taking turns; a row is the slowest
rank's best of ``--repeats`` (ranks start each repeat together), and its ratio to the
all-gather exchange (the reference). For scale, the whole sequences on one process
(SDPA, one thread) are timed first, and, when C divides ``--batch``, data parallelism at
equal tokens: each rank SDPA over b/C whole sequences. ``--documents`` packs documents of
``--doc-length`` tokens (explicit per-document masks instead of the kernels' causal one).

    python -m benchmarks.cp_exchanges
    python -m benchmarks.cp_exchanges --cp 4 --seq 4096 --groups 2 --documents
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F  # noqa: N812

from benchmarks.common import spawn
from megatron3d.cp.attention import COMM_TYPES, context_attention
from megatron3d.cp.layout import rank_index, shard
from megatron3d.cp.tokens import TokenInfo
from megatron3d.mpu import comm
from megatron3d.mpu.state import ParallelState


def _inputs(a: argparse.Namespace) -> tuple[list[torch.Tensor], TokenInfo]:
    """q, k, v, the output gradient over the whole sequence, and its tokens."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(a.heads, a.seq), (a.groups, a.seq), (a.groups, a.seq), (a.heads, a.seq)]
    tensors = [torch.randn(a.batch, h, s, a.head_dim, generator=gen) for h, s in shapes]
    index = torch.arange(a.seq)
    if not a.documents:
        return tensors, TokenInfo(index=index)
    docs = (index // a.doc_length).expand(a.batch, -1)
    return tensors, TokenInfo(index=index, position_ids=(index % a.doc_length).expand(
        a.batch, -1), doc_ids=docs)


def _time(steps: dict[str, object], repeats: int, sync: object) -> dict[str, float]:
    """Each step's best time: the steps take turns, so that a change in the machine's load
    reaches all of them alike, and the best of several is the least disturbed by others'
    work on a shared machine."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats + 1):  # the first round is a warm-up
        for name, step in steps.items():
            sync()
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return {name: min(t[1:]) for name, t in times.items()}


def _whole_step(a: argparse.Namespace, tensors: list[torch.Tensor],
                full: TokenInfo) -> object:
    """Forward + backward of SDPA over whole sequences (the samples of ``tensors``)."""
    q, k, v, grad = tensors
    mask = None
    if full.doc_ids is not None:
        docs = full.doc_ids[:q.shape[0]]
        same = docs[:, None, :, None] == docs[:, None, None, :]
        mask = same & torch.ones(a.seq, a.seq, dtype=torch.bool).tril()

    def run() -> None:
        qkv = [t.detach().requires_grad_() for t in (q, k, v)]
        F.scaled_dot_product_attention(*qkv, attn_mask=mask, is_causal=mask is None,
                                       enable_gqa=a.groups != a.heads).backward(grad)
    return run


def _rank(a: argparse.Namespace) -> dict[str, float]:
    state = ParallelState.build(1, 1, cp_size=a.cp)
    c, r = a.cp, state.cp.rank
    whole, full = _inputs(a)
    q, k, v, grad = (shard(t, 2, c, r) for t in whole)
    cut = None if full.doc_ids is None else (lambda t: shard(t, 1, c, r))
    info = TokenInfo(index=rank_index(a.seq, c, r),
                     position_ids=None if cut is None else cut(full.position_ids),
                     doc_ids=None if cut is None else cut(full.doc_ids))
    flag = torch.zeros(1)

    def step(comm_type: str) -> object:
        def run() -> None:
            qkv = [t.detach().requires_grad_() for t in (q, k, v)]
            context_attention(*qkv, info, state.cp, None, 0.0, comm_type).backward(grad)
        return run
    steps = {comm_type: step(comm_type) for comm_type in COMM_TYPES
             if comm_type != "a2a" or (a.heads % c == 0 and a.groups % c == 0)}
    if a.batch % c == 0:  # data parallel at equal tokens: whole sequences, b/C of them
        share = a.batch // c
        steps["dp"] = _whole_step(a, [t[r * share:(r + 1) * share] for t in whole], full)
    best = _time(steps, a.repeats, lambda: comm.all_reduce(flag, state.cp))
    slowest = comm.all_reduce(torch.tensor(list(best.values())), state.cp, op=comm.MAX)
    return dict(zip(best, slowest.tolist(), strict=True))


def _whole_sequence(a: argparse.Namespace) -> float:
    """One process, one thread: every sample's whole sequence."""
    tensors, full = _inputs(a)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _time({"whole": _whole_step(a, tensors, full)}, a.repeats, lambda: None)["whole"]
    finally:
        torch.set_num_threads(threads)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--documents", action="store_true")
    p.add_argument("--doc-length", type=int, default=300)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    whole = _whole_sequence(a)
    timings = spawn(_rank, a.cp, a)[0]
    out = sys.stdout
    out.write(f"b={a.batch} n={a.heads} G={a.groups} s={a.seq} d={a.head_dim} C={a.cp}"
              f"{' documents' if a.documents else ''}, fp32, forward + backward, best of "
              f"{a.repeats}\n")
    out.write(f"{'whole sequence, 1 process':>26}: {whole * 1e3:8.1f} ms\n")
    for name, t in timings.items():
        label = (f"{name} on {a.cp} ranks" if name != "dp"
                 else f"DP: {a.batch // a.cp} whole per rank")
        out.write(f"{label:>26}: {t * 1e3:8.1f} ms  {t / timings['all_gather']:.2f} x "
                  f"all_gather\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
