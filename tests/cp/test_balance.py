"""The causal work per context-parallel rank: the 2C-chunk layout balances it, contiguous
shards would not; and the exchanges' checks for validation."""

from __future__ import annotations

import pytest

from megatron3d.cp.balance import attention_flops, imbalance
from megatron3d.cp.checks import ring_dropout_error, ulysses_heads_error


def _visible_pairs(indices: list[int]) -> int:
    return sum(i + 1 for i in indices)  # query i sees keys 0..i


@pytest.mark.parametrize("cp_size", [2, 4, 8])
def test_chunk_layout_balances_causal_work(cp_size: int) -> None:
    seq, heads, head_dim = 4096, 8, 64
    flops = attention_flops(seq, cp_size, heads, head_dim)
    c = seq // (2 * cp_size)
    for r, f in enumerate(flops):  # independent count: chunks r and 2C-1-r
        chunks = [*range(r * c, (r + 1) * c), *range((2 * cp_size - 1 - r) * c,
                                                      (2 * cp_size - r) * c)]
        assert f == 4 * heads * head_dim * _visible_pairs(chunks)
    assert sum(flops) == 4 * heads * head_dim * _visible_pairs(list(range(seq)))
    assert imbalance(flops) <= 1.05
    contiguous = imbalance(attention_flops(seq, cp_size, heads, head_dim, balanced=False))
    assert contiguous == pytest.approx(2 * cp_size - 1, rel=0.01)


def test_checks_name_the_fix() -> None:
    assert ring_dropout_error(0.0, "p2p", 2) is None
    assert ring_dropout_error(0.1, "all_gather", 2) is None
    assert ring_dropout_error(0.1, "p2p", 1) is None
    assert "--attention-dropout 0" in ring_dropout_error(0.1, "p2p", 2)
    assert ulysses_heads_error(8, 4, 4) is None
    assert "query groups" in ulysses_heads_error(8, 2, 4)
    assert "heads" in ulysses_heads_error(6, 6, 4)
