"""The ZeRO flag rules (``zero/checks.py``) and the node facts they rest on: each refusal one
line naming the flag and the fix, before any process starts."""

from __future__ import annotations

import dataclasses

import pytest

from megatron3d.config import ParallelConfig
from megatron3d.errors import ConfigError
from megatron3d.mpu.state import ranks_per_node
from megatron3d.zero.checks import check_zero, node_warnings


def _parallel(**fields: object) -> ParallelConfig:
    return dataclasses.replace(ParallelConfig(), **fields)


@pytest.mark.parametrize("fields, named", [
    ({"zero3_shard_group": "node"}, "--zero3-shard-group node"),
    ({"zero3_secondary_shard": "node", "zero_stage": 1}, "--zero3-secondary-shard node"),
    ({"zero3_quantize_weights": True}, "--zero3-quantize-weights"),
    ({"zero3_quantize_grads": True}, "--zero3-quantize-grads"),
])
def test_node_flags_need_zero3(fields: dict, named: str) -> None:
    with pytest.raises(ConfigError, match=f"^{named} is a ZeRO-3 option .*--zero-stage 3"):
        check_zero(_parallel(**fields), 4)
    check_zero(_parallel(**{**fields, "zero_stage": 3}), 4)


def test_hybrid_and_secondary_shard_exclude_each_other() -> None:
    both = _parallel(zero_stage=3, zero3_shard_group="node", zero3_secondary_shard="node")
    with pytest.raises(ConfigError, match="pass one of the two"):
        check_zero(both, 4)


def test_gpus_per_node_must_divide_the_world() -> None:
    with pytest.raises(ConfigError, match="--gpus-per-node=3 does not divide the world of 4"):
        check_zero(_parallel(gpus_per_node=3), 4)
    check_zero(_parallel(gpus_per_node=2), 4)


def test_tensor_parallelism_crossing_nodes_is_warned() -> None:
    assert node_warnings(_parallel(tensor_model_parallel_size=4), 8) == []
    assert node_warnings(_parallel(tensor_model_parallel_size=1), 3) == []
    (warning,) = node_warnings(_parallel(tensor_model_parallel_size=4), 2)
    assert "groups of 4 cross nodes of 2 ranks" in warning


def test_ranks_per_node_from_the_flag_then_the_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert ranks_per_node(0, 8) == 8  # not launched: one node
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert ranks_per_node(0, 8) == 4
    assert ranks_per_node(2, 8) == 2  # the flag wins
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")  # more than the world: not a node of it
    assert ranks_per_node(0, 8) == 8
