"""TP layers and vocab-parallel cross entropy against torch references on the full tensors.

Each check builds the full reference from the same seeded values, runs the TP layer, and
compares the forward output and every gradient (this rank's slice of it). TP=1 runs in this
process without torch.distributed; TP=2 and TP=4 run every check in one spawn per size.
"""

from __future__ import annotations

import functools
import traceback
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - the conventional alias

from megatron3d.mpu.cross_entropy import vocab_parallel_cross_entropy
from megatron3d.mpu.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from megatron3d.mpu.meta import get_meta
from megatron3d.mpu.random import seeded_normal
from megatron3d.mpu.sharding import tp_shard, tp_unshard
from megatron3d.mpu.state import AxisGroup, ParallelState
from megatron3d.mpu.topology import Topology
from tests.helpers.dist import run_distributed

# fp32 tolerances: TP only reorders the reductions (sums over the split dimension).
RTOL, ATOL = 1e-5, 1e-6
SEED, STD = 1234, 0.02
S, B, IN, OUT = 5, 3, 16, 24  # OUT divides by tp * stride for tp in {1, 2, 4}, stride 2


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL)


def _leaf(shape: tuple[int, ...], name: str) -> torch.Tensor:
    return seeded_normal(shape, 1.0, SEED, name).requires_grad_()


def check_column(tp: AxisGroup, gather: bool, stride: int, bias: bool) -> None:
    layer = ColumnParallelLinear(IN, OUT, tp=tp, name="col", seed=SEED, init_std=STD,
                                 bias=bias, gather_output=gather, stride=stride)
    b_ref = None
    if bias:  # a non-zero bias, so a mix-up of its slices shows in the output
        b_ref = seeded_normal((OUT,), 1.0, SEED, "col.bias_value").requires_grad_()
        with torch.no_grad():
            layer.bias.copy_(tp_shard(b_ref, 0, tp.rank, tp.size, stride))
    w_ref = seeded_normal((OUT, IN), STD, SEED, "col.weight").requires_grad_()
    x_ref, x = _leaf((S, B, IN), "x"), _leaf((S, B, IN), "x")
    dy = seeded_normal((S, B, OUT), 1.0, SEED, "dy")  # [s, b, out]

    y_ref = F.linear(x_ref, w_ref, b_ref)
    y_ref.backward(dy)
    y = layer(x)
    shard = (lambda t: t) if gather else functools.partial(
        tp_shard, dim=2, rank=tp.rank, size=tp.size, stride=stride)
    _close(y, shard(y_ref.detach()))
    y.backward(shard(dy))
    _close(x.grad, x_ref.grad)
    _close(layer.weight.grad, tp_shard(w_ref.grad, 0, tp.rank, tp.size, stride))
    if bias:
        _close(layer.bias.grad, tp_shard(b_ref.grad, 0, tp.rank, tp.size, stride))
    assert get_meta(layer.weight).tp_split_dim == 0
    assert get_meta(layer.weight).tp_stride == stride


def check_row(tp: AxisGroup, input_is_parallel: bool) -> None:
    layer = RowParallelLinear(OUT, IN, tp=tp, name="row", seed=SEED, init_std=STD,
                              input_is_parallel=input_is_parallel)
    full_bias = seeded_normal((IN,), 1.0, SEED, "row.bias_value")
    with torch.no_grad():
        layer.bias.copy_(full_bias)
    # Drawn in blocks of columns, the dimension it is split along.
    w_ref = seeded_normal((IN, OUT), STD, SEED, "row.weight", dim=1).requires_grad_()
    b_ref = full_bias.clone().requires_grad_()
    x_ref = _leaf((S, B, OUT), "x")
    dy = seeded_normal((S, B, IN), 1.0, SEED, "dy")  # [s, b, in]
    y_ref = F.linear(x_ref, w_ref, b_ref)
    y_ref.backward(dy)

    x_full = _leaf((S, B, OUT), "x")
    x = x_full if not input_is_parallel else (
        tp_shard(x_full.detach(), 2, tp.rank, tp.size).requires_grad_())
    y = layer(x)
    _close(y, y_ref.detach())
    y.backward(dy)
    expected_x_grad = x_ref.grad if not input_is_parallel else tp_shard(
        x_ref.grad, 2, tp.rank, tp.size)
    _close(x.grad, expected_x_grad)
    _close(layer.weight.grad, tp_shard(w_ref.grad, 1, tp.rank, tp.size))
    _close(layer.bias.grad, b_ref.grad)
    assert get_meta(layer.bias).tp_split_dim is None
    assert get_meta(layer.bias).no_weight_decay


def check_embedding(tp: AxisGroup, padded: int, logical: int) -> None:
    layer = VocabParallelEmbedding(padded, IN, tp=tp, name="emb", seed=SEED, init_std=STD,
                                   logical_vocab_size=logical)
    w_ref = torch.zeros(padded, IN)  # [v_pad, h]: logical rows drawn, padding rows zero
    w_ref[:logical] = seeded_normal((logical, IN), STD, SEED, "emb.weight")
    w_ref.requires_grad_()
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, logical, (B, S), generator=gen)  # [b, s]
    ids[0, 0], ids[0, 1] = 0, logical - 1  # both ends of the vocabulary
    dy = seeded_normal((B, S, IN), 1.0, SEED, "dy")  # [b, s, h]
    y_ref = F.embedding(ids, w_ref)
    y_ref.backward(dy)
    y = layer(ids)
    _close(y, y_ref.detach())
    y.backward(dy)
    _close(layer.weight.grad, tp_shard(w_ref.grad, 0, tp.rank, tp.size))
    local_rows = torch.arange(layer.weight.shape[0]) + tp.rank * layer.weight.shape[0]
    assert layer.weight.detach()[local_rows >= logical].abs().sum() == 0


def check_cross_entropy(tp: AxisGroup, padded: int, logical: int) -> None:
    logits_full = seeded_normal((S, B, padded), 3.0, SEED, "logits")  # padding cols non-zero
    labels = torch.randint(0, logical, (S, B), generator=torch.Generator().manual_seed(3))
    labels[0, 0] = logical - 1
    ref_logits = logits_full[..., :logical].clone().requires_grad_()
    loss_ref = F.cross_entropy(ref_logits.reshape(-1, logical), labels.reshape(-1),
                               reduction="none").view(S, B)
    dloss = seeded_normal((S, B), 1.0, SEED, "dloss")
    loss_ref.backward(dloss)
    grad_ref = torch.zeros(S, B, padded)
    grad_ref[..., :logical] = ref_logits.grad

    logits = tp_shard(logits_full, 2, tp.rank, tp.size).requires_grad_()  # [s, b, v/tp]
    loss = vocab_parallel_cross_entropy(logits, labels, tp, logical)
    _close(loss, loss_ref.detach())
    loss.backward(dloss)
    _close(logits.grad, tp_shard(grad_ref, 2, tp.rank, tp.size))

    half = logits.detach().bfloat16().requires_grad_()
    loss_bf16 = vocab_parallel_cross_entropy(half, labels, tp, logical)
    assert loss_bf16.dtype == torch.float32
    loss_bf16.sum().backward()
    assert half.grad.dtype == torch.bfloat16


CHECKS: dict[str, Callable[[AxisGroup], None]] = {
    **{f"column-gather{g}-stride{s}-bias{b}": functools.partial(
        check_column, gather=g, stride=s, bias=b)
       for g in (False, True) for s in (1, 2) for b in (True, False)},
    "row-parallel-input": functools.partial(check_row, input_is_parallel=True),
    "row-full-input": functools.partial(check_row, input_is_parallel=False),
    "embedding-vocab203-pad208": functools.partial(check_embedding, padded=208, logical=203),
    "embedding-vocab100-pad256": functools.partial(check_embedding, padded=256, logical=100),
    "xent-vocab203-pad208": functools.partial(check_cross_entropy, padded=208, logical=203),
    "xent-vocab100-pad256": functools.partial(check_cross_entropy, padded=256, logical=100),
    "xent-unpadded": functools.partial(check_cross_entropy, padded=32, logical=32),
}


def _run_checks(tp: AxisGroup) -> dict[str, str | None]:
    """Every check on this rank: name -> None, or the traceback of its failure."""
    results: dict[str, str | None] = {}
    for name, check in CHECKS.items():
        try:
            check(tp)
            results[name] = None
        except Exception:
            results[name] = traceback.format_exc()
    return results


def _worker(tp_size: int) -> dict[str, str | None]:
    return _run_checks(ParallelState.build(tp_size, 1).tp)


@pytest.fixture(scope="module")
def results_by_tp() -> Callable[[int], list[dict[str, str | None]]]:
    """One run of every check per TP size, shared by the parametrized tests below."""
    cache: dict[int, list[dict[str, str | None]]] = {}

    def get(tp_size: int) -> list[dict[str, str | None]]:
        if tp_size not in cache:
            cache[tp_size] = ([_run_checks(AxisGroup.single())] if tp_size == 1
                              else run_distributed(_worker, tp_size, tp_size))
        return cache[tp_size]

    return get


@pytest.mark.parametrize("check", list(CHECKS))
@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_matches_reference(results_by_tp: Callable, tp_size: int, check: str) -> None:
    for rank, results in enumerate(results_by_tp(tp_size)):
        assert results[check] is None, f"rank {rank} of TP={tp_size}:\n{results[check]}"


def _describe_state(tp_size: int, pp_size: int) -> dict:
    state = ParallelState.build(tp_size, pp_size)
    axes = {k: getattr(state, k) for k in ("tp", "dp", "pp", "mp", "embedding")}
    sums = {}
    for name, axis in axes.items():
        if axis.is_member:  # prove the group is real: sum of member world ranks
            t = torch.tensor([float(state.world_rank)])
            torch.distributed.all_reduce(t, group=axis.group)
            sums[name] = t.item()
    return {"rank": state.world_rank,
            "axes": {k: (a.rank, a.size, a.ranks) for k, a in axes.items()},
            "sums": sums,
            "flags": (state.is_first_stage, state.is_last_stage, state.in_embedding_group)}


def _describe_two_layouts() -> list[dict]:
    return [_describe_state(2, 2), _describe_state(1, 4)]


def test_parallel_state_groups_world8() -> None:
    described = run_distributed(_describe_two_layouts, 8)
    for layout_index, (tp, pp) in enumerate([(2, 2), (1, 4)]):
        topo = Topology(8, tp, pp)
        expected_groups = {"tp": topo.tp_groups(), "dp": topo.dp_groups(),
                           "pp": topo.pp_groups(), "mp": topo.model_parallel_groups(),
                           "embedding": topo.embedding_groups()}
        for rank, per_layout in enumerate(described):
            info = per_layout[layout_index]
            assert info["rank"] == rank
            for name, groups in expected_groups.items():
                mine = [g for g in groups if rank in g]
                axis_rank, size, ranks = info["axes"][name]
                if not mine:  # a middle pipeline stage: outside the embedding group
                    assert name == "embedding" and (axis_rank, size, ranks) == (-1, 0, ())
                    continue
                assert (axis_rank, size, ranks) == (mine[0].index(rank), len(mine[0]), mine[0])
                assert info["sums"][name] == sum(mine[0])
            c = topo.coords(rank)
            assert info["flags"] == (c.pp_rank == 0, c.pp_rank == pp - 1,
                                     c.pp_rank in (0, pp - 1))


def test_single_state_needs_no_distributed() -> None:
    state = ParallelState.single()
    assert (state.tp.size, state.pp.size, state.dp.size, state.world_size) == (1, 1, 1, 1)
    assert state.tp.group is None and state.tp.ranks == (0,)
    assert state.is_first_stage and state.is_last_stage and state.in_embedding_group


@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("size", [1, 2, 4])
def test_unshard_inverts_shard(size, dim, stride):
    full = torch.arange(8 * 16, dtype=torch.float32).view(8, 16)
    shards = [tp_shard(full, dim, r, size, stride) for r in range(size)]
    assert torch.equal(tp_unshard(shards, dim, stride), full)
