"""Sharded initialisation: each TP rank draws only its slices of a weight, and they are
bitwise the slices of the weight a single process draws.

The layers are built in this process for every rank of a TP group (building draws and
communicates nothing), with weights of several ``BLOCK_NUMEL`` blocks whose TP slices start
and end inside blocks.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from megatron3d.mpu.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from megatron3d.mpu.random import BLOCK_NUMEL, seeded_normal
from megatron3d.mpu.sharding import tp_shard
from megatron3d.mpu.state import AxisGroup
from tests.helpers.device import rank_device

SEED, STD, NAME = 1234, 0.02, "w"
H, WIDE = 96, 9600  # [9600, 96]: 682 rows of 96 in a block, 15 blocks; 9600 = 8 * 1200
VOCAB, PADDED = 8003, 8064  # 8064 = 4 ranks * 2016 rows: rank 3's rows 6048.. are 1955 real
SHORT_VOCAB = 6000  # rank 3 of 4 holds only padding rows

Build = Callable[..., nn.Module]  # (tp, device=None) -> layer
CPU = torch.device("cpu")


def _group(rank: int, size: int) -> AxisGroup:
    return AxisGroup(group=None, rank=rank, size=size, ranks=tuple(range(size)))


def _column(stride: int, dtype: torch.dtype = torch.float32) -> Build:
    return lambda tp, device=None: ColumnParallelLinear(
        H, WIDE, tp=tp, name=NAME, seed=SEED, init_std=STD, stride=stride, params_dtype=dtype,
        device=device)


def _row(tp: AxisGroup, device: torch.device | None = None) -> nn.Module:
    return RowParallelLinear(WIDE, H, tp=tp, name=NAME, seed=SEED, init_std=STD, device=device)


def _embedding(logical: int) -> Build:
    return lambda tp, device=None: VocabParallelEmbedding(
        PADDED, H, tp=tp, name=NAME, seed=SEED, init_std=STD, logical_vocab_size=logical,
        device=device)


def _padded(logical: torch.Tensor) -> torch.Tensor:
    full = torch.zeros(PADDED, H, device=logical.device)
    full[:logical.shape[0]] = logical
    return full


CASES = {  # build, split dim, stride, the single process's full tensor (as the layer holds it)
    "column dim 0": (_column(1), 0, 1,
                     lambda d=CPU: seeded_normal((WIDE, H), STD, SEED, "w.weight", d)),
    "row dim 1": (_row, 1, 1,
                  lambda d=CPU: seeded_normal((H, WIDE), STD, SEED, "w.weight", d, dim=1)),
    "column stride 2": (_column(2), 0, 2,
                        lambda d=CPU: seeded_normal((WIDE, H), STD, SEED, "w.weight", d)),
    "padded vocabulary": (_embedding(VOCAB), 0, 1, lambda d=CPU: _padded(
        seeded_normal((VOCAB, H), STD, SEED, "w.weight", d))),
    "vocabulary shard of padding": (_embedding(SHORT_VOCAB), 0, 1, lambda d=CPU: _padded(
        seeded_normal((SHORT_VOCAB, H), STD, SEED, "w.weight", d))),
}


@pytest.mark.cuda
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("tp", [2, 3, 4])
def test_each_rank_draws_its_slice_of_the_single_process_weight(case, tp):
    build, dim, stride, full = CASES[case]
    device = rank_device()
    single = build(AxisGroup.single(), device).weight.detach()
    assert single.device == device
    assert torch.equal(single, full(device))  # what one process holds: the logical tensor
    for rank in range(tp):
        mine = build(_group(rank, tp), device).weight.detach()
        assert torch.equal(mine, tp_shard(single, dim, rank, tp, stride)), f"rank {rank}"


@pytest.mark.parametrize("padded", [VOCAB, PADDED, 8192])
def test_the_padded_vocabulary_size_never_changes_a_value(padded):
    """The padded size depends on TP (and --make-vocab-size-divisible-by): the real rows must
    not, and the padding rows are zero."""
    table = VocabParallelEmbedding(padded, H, tp=AxisGroup.single(), name=NAME, seed=SEED,
                                   init_std=STD, logical_vocab_size=VOCAB).weight.detach()
    assert torch.equal(table[:VOCAB], seeded_normal((VOCAB, H), STD, SEED, "w.weight"))
    assert not table[VOCAB:].any()


@pytest.mark.cuda
def test_low_precision_weights_are_the_rounded_fp32_values():
    device = rank_device()
    single = _column(1)(AxisGroup.single(), device).weight.detach()
    mine = _column(1, torch.bfloat16)(_group(1, 4), device).weight.detach()
    assert mine.dtype == torch.bfloat16
    assert torch.equal(mine, tp_shard(single, 0, 1, 4).to(torch.bfloat16))


def _drawn_numel(monkeypatch: pytest.MonkeyPatch, build: Build, tp: AxisGroup) -> int:
    """How many values building the layer on ``tp`` drew."""
    drawn, normal = [], torch.Tensor.normal_

    def counting(self: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        drawn.append(self.numel())
        return normal(self, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(torch.Tensor, "normal_", counting)
        build(tp)
    return sum(drawn)


@pytest.mark.parametrize("case", ["column dim 0", "row dim 1", "column stride 2",
                                  "padded vocabulary"])
def test_a_rank_draws_only_the_blocks_its_slices_touch(monkeypatch, case):
    """At most one block more at each end of each range, and far less than the weight."""
    build, _, stride, _ = CASES[case]
    logical = _drawn_numel(monkeypatch, build, AxisGroup.single())
    assert logical == (VOCAB if "vocabulary" in case else WIDE) * H  # each value once
    for rank in range(4):
        slice_numel = build(_group(rank, 4)).weight.numel()
        drawn = _drawn_numel(monkeypatch, build, _group(rank, 4))
        assert drawn <= slice_numel + 2 * stride * BLOCK_NUMEL, f"rank {rank}"
        assert drawn < logical / 2, f"rank {rank}"


def test_a_rank_holding_only_vocabulary_padding_draws_nothing(monkeypatch):
    assert _drawn_numel(monkeypatch, _embedding(SHORT_VOCAB), _group(3, 4)) == 0


def test_without_drawing_the_weights_are_zeros(monkeypatch):
    """Under --load the checkpoint fills the weights: building draws nothing."""
    def refuse(*args, **kwargs) -> None:
        raise AssertionError("drew initial weights")

    monkeypatch.setattr(torch.Tensor, "normal_", refuse)
    for layer in (ColumnParallelLinear(H, WIDE, tp=_group(1, 2), name=NAME, seed=SEED,
                                       init_std=STD, draw_weights=False),
                  RowParallelLinear(WIDE, H, tp=_group(1, 2), name=NAME, seed=SEED,
                                    init_std=STD, draw_weights=False),
                  VocabParallelEmbedding(PADDED, H, tp=_group(1, 2), name=NAME, seed=SEED,
                                         init_std=STD, logical_vocab_size=VOCAB,
                                         draw_weights=False)):
        assert not layer.weight.any()
