"""Deferred initialisation (``megatron3d/mpu/init.py``): any flat range of a parameter drawn
alone is bitwise that range of the parameter drawn whole, for every kind of slice a layer
makes (row or column split, a strided SwiGLU split, a padded vocabulary table), and binding a
meta parameter keeps its identity and its own version counter."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megatron3d.mpu.init import Constant, Normal, bind, fill, fill_flat
from megatron3d.mpu.random import BLOCK_NUMEL

INITS = {
    # ColumnParallelLinear, TP rank 1 of 2 with stride 2 (SwiGLU): two row slices
    "rows-strided": (Normal(0.02, 7, "fc1.weight", (48, 40), 0, ((12, 24), (36, 48))),
                     (24, 40)),
    # RowParallelLinear, TP rank 1 of 2: a column slice, tall enough for several column
    # blocks (BLOCK_NUMEL // rows columns each)
    "columns": (Normal(0.02, 7, "fc2.weight", (2 * BLOCK_NUMEL // 16, 64), 1, ((32, 64),)),
                (2 * BLOCK_NUMEL // 16, 32)),
    # VocabParallelEmbedding, the last TP rank: 5 logical rows, then 3 padding rows
    "padded-vocab": (Normal(1.0, 3, "word_embeddings.weight", (13, 16), 0, ((8, 13),)),
                     (8, 16)),
    # a TP rank holding only padding rows
    "padding-only": (Normal(1.0, 3, "word_embeddings.weight", (13, 16), 0, ()), (4, 16)),
    "ones": (Constant(1.0), (24,)),
}


def _ranges(numel: int) -> list[tuple[int, int]]:
    """Whole, empty, single elements, row-straddling and block-straddling ranges."""
    cuts = sorted({c for c in (0, 1, 7, 40, 41, numel // 3, numel // 2 + 5, numel - 1, numel)
                   if c <= numel})
    return [(0, numel), (5, 5), *zip(cuts, cuts[1:], strict=False), (3, numel - 2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", sorted(INITS))
def test_a_flat_range_drawn_alone_is_that_range_of_the_whole(kind, dtype):
    init, shape = INITS[kind]
    whole = fill(init, torch.empty(shape, dtype=dtype)).view(-1)
    for start, end in _ranges(whole.numel()):
        part = fill_flat(init, shape, torch.full((end - start,), -1.0, dtype=dtype), start, end)
        assert torch.equal(part, whole[start:end]), (kind, start, end)


def test_padding_rows_are_zero_and_the_rest_is_drawn():
    init, shape = INITS["padded-vocab"]
    table = fill(init, torch.empty(shape))
    assert torch.equal(table[5:], torch.zeros(3, 16))
    assert table[:5].std() > 0.5


def test_binding_a_meta_parameter_keeps_it_and_draws_its_value():
    init = Normal(0.02, 1, "w", (3, 4), 0, ((0, 3),))
    layer = nn.Linear(4, 3, bias=False, device="meta")
    param = layer.weight
    param.tag = "kept"
    storage = torch.zeros(20)
    bind(param, storage[4:16], init)
    assert layer.weight is param and param.tag == "kept" and not param.is_meta
    assert torch.equal(param.detach(), fill(init, torch.empty(3, 4)))
    assert param.data_ptr() == storage[4:].data_ptr()  # a view: writes land in the buffer
    version = param._version
    storage.add_(1.0)  # ZeRO-3 refills its slots in place; autograd must not object
    assert param._version == version


def test_binding_a_real_parameter_copies_it():
    param = nn.Parameter(torch.arange(6.0).view(2, 3))
    storage = torch.zeros(6)
    bind(param, storage)
    assert torch.equal(storage, torch.arange(6.0)) and param.data_ptr() == storage.data_ptr()
