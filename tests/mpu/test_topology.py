"""Rank-grid math for many layouts, without processes."""

from __future__ import annotations

import itertools

import pytest

from megatron3d.errors import ConfigError
from megatron3d.mpu.topology import Topology

# (world_size, tp, pp): every combination of small sizes, plus odd ones (TP=3, PP=3, ...).
LAYOUTS = sorted(
    {(tp * dp * pp, tp, pp) for tp, dp, pp in itertools.product((1, 2, 4), (1, 2, 3), (1, 2, 4))}
    | {(3, 3, 1), (3, 1, 3), (6, 3, 2), (9, 3, 3), (12, 2, 3), (16, 8, 2), (64, 8, 4)})


def test_enough_layouts() -> None:
    assert len(LAYOUTS) >= 20


def _kinds(topo: Topology) -> dict[str, tuple[list[tuple[int, ...]], int]]:
    """Group kind -> (member lists, expected group size)."""
    return {"tp": (topo.tp_groups(), topo.tp), "dp": (topo.dp_groups(), topo.dp),
            "pp": (topo.pp_groups(), topo.pp),
            "mp": (topo.model_parallel_groups(), topo.tp * topo.pp)}


@pytest.mark.parametrize(("world_size", "tp", "pp"), LAYOUTS)
def test_coords_round_trip(world_size: int, tp: int, pp: int) -> None:
    topo = Topology(world_size, tp, pp)
    assert topo.dp * tp * pp == world_size
    seen = set()
    for rank in range(world_size):
        c = topo.coords(rank)
        assert rank == c.pp_rank * (topo.dp * tp) + c.dp_rank * tp + c.tp_rank
        assert topo.rank_of(*c) == rank
        seen.add(tuple(c))
    assert len(seen) == world_size


@pytest.mark.parametrize(("world_size", "tp", "pp"), LAYOUTS)
def test_every_rank_in_exactly_one_group_of_each_kind(world_size: int, tp: int, pp: int) -> None:
    topo = Topology(world_size, tp, pp)
    for kind, (groups, size) in _kinds(topo).items():
        members = [r for g in groups for r in g]
        assert sorted(members) == list(range(world_size)), kind
        assert all(len(g) == size for g in groups), kind
        assert len(groups) == world_size // size, kind


@pytest.mark.parametrize(("world_size", "tp", "pp"), LAYOUTS)
def test_groups_vary_only_their_axis(world_size: int, tp: int, pp: int) -> None:
    topo = Topology(world_size, tp, pp)
    fixed = {"tp": ("dp_rank", "pp_rank"), "dp": ("tp_rank", "pp_rank"),
             "pp": ("tp_rank", "dp_rank"), "mp": ("dp_rank",)}
    for kind, (groups, _) in _kinds(topo).items():
        for group in groups:
            coords = [topo.coords(r) for r in group]
            for axis in fixed[kind]:
                assert len({getattr(c, axis) for c in coords}) == 1, (kind, group)


@pytest.mark.parametrize(("world_size", "tp", "pp"), LAYOUTS)
def test_embedding_groups(world_size: int, tp: int, pp: int) -> None:
    topo = Topology(world_size, tp, pp)
    groups = topo.embedding_groups()
    assert len(groups) == topo.dp * tp
    for group, stages in zip(groups, topo.pp_groups(), strict=True):
        assert group == ((stages[0], stages[-1]) if pp > 1 else (stages[0],))
        assert topo.coords(group[0]).pp_rank == 0
        assert topo.coords(group[-1]).pp_rank == pp - 1


def test_megatron_order_spot_checks() -> None:
    topo = Topology(16, tp=2, pp=4)  # dp = 2
    assert topo.dp == 2
    assert topo.tp_groups()[:3] == [(0, 1), (2, 3), (4, 5)]
    assert topo.dp_groups()[:3] == [(0, 2), (1, 3), (4, 6)]
    assert topo.pp_groups()[0] == (0, 4, 8, 12)
    assert topo.pp_groups()[3] == (3, 7, 11, 15)
    assert topo.model_parallel_groups() == [(0, 1, 4, 5, 8, 9, 12, 13),
                                            (2, 3, 6, 7, 10, 11, 14, 15)]
    assert topo.embedding_groups() == [(0, 12), (1, 13), (2, 14), (3, 15)]
    assert topo.coords(13) == (1, 0, 3, 0)
    assert topo.rank_of(tp_rank=1, dp_rank=1, pp_rank=2) == 11


def test_pp1_embedding_is_first_stage_only() -> None:
    topo = Topology(8, tp=2, pp=1)
    assert topo.embedding_groups() == [(r,) for r in range(8)]


def test_table_lists_every_rank_and_group() -> None:
    text = Topology(8, tp=2, pp=2).table()
    assert text.splitlines()[0].startswith("world 8 = tp 2 x dp 2 x pp 2")
    assert "tp groups: [0, 1] [2, 3] [4, 5] [6, 7]" in text
    assert "embedding groups: [0, 4] [1, 5] [2, 6] [3, 7]" in text
    assert len(text.splitlines()) == 2 + 8 + 5


@pytest.mark.parametrize(("world_size", "tp", "pp"),
                         [(6, 4, 1), (8, 3, 1), (8, 1, 3), (12, 5, 2), (0, 1, 1), (4, 0, 1),
                          (4, 1, -2)])
def test_invalid_layouts_raise_config_error(world_size: int, tp: int, pp: int) -> None:
    with pytest.raises(ConfigError) as info:
        Topology(world_size, tp, pp)
    assert "\n" not in str(info.value)


def test_out_of_range_rank() -> None:
    topo = Topology(4, tp=2, pp=1)
    with pytest.raises(ValueError, match="outside"):
        topo.coords(4)
    with pytest.raises(ValueError, match="outside"):
        topo.rank_of(2, 0, 0)


def test_context_parallel_ranks_sit_between_tensor_and_data_parallel() -> None:
    """Megatron's order tp-cp-dp-pp: rank = ((pp*dp + dp_rank)*cp + cp_rank)*tp + tp_rank."""
    topo = Topology(world_size=16, tp=2, pp=2, cp=2)
    assert topo.dp == 2
    for rank in range(16):
        c = topo.coords(rank)
        assert rank == ((c.pp_rank * 2 + c.dp_rank) * 2 + c.cp_rank) * 2 + c.tp_rank
        assert topo.rank_of(c.tp_rank, c.dp_rank, c.pp_rank, c.cp_rank) == rank
    assert topo.cp_groups()[:2] == [(0, 2), (1, 3)]
    assert topo.dp_groups()[:2] == [(0, 4), (1, 5)]
    assert topo.dp_cp_groups()[0] == (0, 2, 4, 6)
    for groups in (topo.tp_groups(), topo.cp_groups(), topo.dp_groups(), topo.dp_cp_groups(),
                   topo.pp_groups()):  # each axis's groups partition the world
        assert sorted(r for g in groups for r in g) == list(range(16))
    assert topo.model_parallel_groups()[0] == (0, 1, 8, 9)


def test_without_context_parallelism_the_groups_are_unchanged() -> None:
    plain, with_cp = Topology(8, tp=2, pp=2), Topology(8, tp=2, pp=2, cp=1)
    assert plain.dp_cp_groups() == plain.dp_groups() == with_cp.dp_groups()
    assert "cp" not in plain.table().splitlines()[1]


def test_a_world_that_context_parallelism_does_not_divide_is_refused() -> None:
    with pytest.raises(ConfigError, match="--context-parallel-size"):
        Topology(world_size=6, tp=1, pp=1, cp=4)


def test_node_split_cuts_each_group_by_node() -> None:
    """tp 2 x dp 4 on nodes of 4 ranks: the dp group (0, 2, 4, 6) is (0, 2) on node 0 and
    (4, 6) on node 1; its counterparts across nodes are (0, 4) and (2, 6)."""
    topo = Topology(world_size=8, tp=2, pp=1)
    intra, inter = topo.node_split(topo.dp_cp_groups(), 4)
    assert intra == [(0, 2), (4, 6), (1, 3), (5, 7)]
    assert inter == [(0, 4), (2, 6), (1, 5), (3, 7)]
    one_node_intra, one_node_inter = topo.node_split(topo.dp_cp_groups(), 8)
    assert one_node_intra == topo.dp_cp_groups()
    assert one_node_inter == [(0,), (2,), (4,), (6,), (1,), (3,), (5,), (7,)]


def test_node_split_refuses_uneven_nodes() -> None:
    topo = Topology(world_size=6, tp=1, pp=1)
    with pytest.raises(ConfigError, match="do not split the world"):
        topo.node_split(topo.dp_cp_groups(), 4)
    topo = Topology(world_size=12, tp=1, pp=2)  # dp group 0..5: 4 on node 0, 2 on node 1
    with pytest.raises(ConfigError, match=r"spread unevenly .*\[2, 4\] per node"):
        topo.node_split(topo.dp_cp_groups(), 4)
