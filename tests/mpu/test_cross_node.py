"""The cross-node byte counter, called directly with hand-made axes: what a rank receives from
other nodes under each collective's logical algorithm, counted by hand; and on a real 4-rank
ZeRO-3 run as 2 nodes x 2, against the accounting."""

from __future__ import annotations

import dataclasses

import torch

from megatron3d.accounting.nodes import Nodes, received, zero3_collectives
from megatron3d.config import ParallelConfig
from megatron3d.mpu.state import AxisGroup
from megatron3d.mpu.traffic import CrossNodeCounter, observing
from tests.helpers.dist import run_distributed
from tests.helpers.runs import build
from tests.helpers.tiny import train_argv

# 8 ranks as 2 nodes x 4; this rank is 1 (node 0).
ME = 1


def _axis(ranks: tuple[int, ...], name: str) -> AxisGroup:
    return AxisGroup(group=None, rank=ranks.index(ME), size=len(ranks), ranks=ranks, name=name)


def _fp32(numel: int) -> torch.Tensor:
    return torch.zeros(numel)


def test_collectives_count_what_arrives_from_other_nodes():
    counter = CrossNodeCounter(ranks_per_node=4, world_rank=ME)
    world = _axis((0, 1, 2, 3, 4, 5, 6, 7), "dp_cp")  # 4 members on node 1
    counter("all_gather", _fp32(10), world)  # 10 fp32 from each of 4 members: 160 B
    counter("reduce_scatter", _fp32(80), world)  # chunk of 10 from each of 4: 160 B
    counter("all_reduce", _fp32(80), world)  # twice the chunk of 10 from each of 4: 320 B
    counter("all_to_all", torch.zeros(16, dtype=torch.int8), world)  # 2 B from each of 4
    assert counter.bytes == {"dp_cp": 160 + 160 + 320 + 8}
    assert counter.total_bytes() == 648


def test_members_on_this_node_cost_nothing():
    counter = CrossNodeCounter(ranks_per_node=4, world_rank=ME)
    intra = _axis((0, 1, 2, 3), "dp_intra")
    inter = _axis((1, 5), "dp_inter")  # one member elsewhere
    for kind in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all"):
        counter(kind, _fp32(8), intra)
    counter("all_gather", _fp32(8), inter)  # 32 B
    counter("reduce_scatter", _fp32(8), inter)  # half of 32 B
    counter("all_reduce", torch.zeros(8, dtype=torch.bfloat16), inter)  # 2 x 8 B
    assert counter.bytes == {"dp_inter": 32 + 16 + 16}


def test_point_to_point_and_broadcast_count_when_the_sender_is_elsewhere():
    counter = CrossNodeCounter(ranks_per_node=4, world_rank=ME)
    pp = _axis((1, 5), "pp")
    counter("recv", _fp32(3), pp, 5)  # from node 1: 12 B
    counter("send", _fp32(3), pp, 5)  # the receiver counts it, not this rank
    counter("recv", _fp32(3), _axis((1, 2), "pp"), 2)  # same node
    world = _axis((0, 1, 2, 3, 4, 5, 6, 7), "world")
    counter("broadcast", _fp32(5), world, 6)  # source on node 1: 20 B
    counter("broadcast", _fp32(5), world, 0)  # source here
    counter("barrier", torch.empty(0), world)
    assert counter.bytes == {"pp": 12, "world": 20}
    counter.reset()
    assert counter.total_bytes() == 0


def test_uneven_chunks_and_size_one_axes():
    counter = CrossNodeCounter(ranks_per_node=2, world_rank=ME)
    counter("all_gather", _fp32(4), _axis((1,), "dp_inter"))  # alone: nothing
    counter("reduce_scatter", _fp32(12), _axis((0, 1, 2), "dp_cp"))  # 4 fp32 from rank 2
    assert counter.bytes == {"dp_cp": 16}


def _bytes_per_step(*flags: str) -> dict:
    """A ZeRO-3 run of 4 ranks as 2 nodes x 2: each step's bytes from the other node, by
    axis, and the stage's padded parameter count."""
    counter = CrossNodeCounter(2, torch.distributed.get_rank())
    steps: list[dict] = []

    def record(_: int, __: object) -> None:
        steps.append(dict(counter.bytes))
        counter.reset()

    trainer, _ = build(train_argv("gpt2", 3, "--zero-stage", "3", "--gpus-per-node", "2",
                                  *flags), on_step=record)
    with observing(counter):
        trainer.run()
    return {"steps": steps, "numel": trainer.model.data_parallel.shard.layout.numel}


def test_a_flat_zero3_step_crosses_what_the_accounting_says():
    """Kept for the step (one gather and one reduction per unit, every unit a multiple of 4
    elements): a rank gets N/4 fp32 of each unit from each of the 2 ranks on the other node
    when gathering and when reducing: 4N bytes, the accounting's figure, plus the step's two
    one-element fp32 all-reduces over DP (4 bytes each from the other node)."""
    for r in run_distributed(_bytes_per_step, 4, "--zero3-reshard-after-forward", "false"):
        n = r["numel"]
        expected = received(zero3_collectives(n, _kept(), Nodes(2, 2), 4, 4), Nodes(2, 2))
        assert expected.inter == 4 * n
        assert r["steps"][-1]["dp"] - expected.inter == 8


def _kept() -> ParallelConfig:
    return dataclasses.replace(ParallelConfig(), zero_stage=3,
                               zero3_reshard_after_forward="false")


def _ratios_to_flat(*flags: str) -> dict[str, float]:
    """Bytes from the other node in the second step (the first gathers alike), each mode
    over flat ZeRO-3, one spawn for all of them."""
    modes = {"flat": (), "secondary": ("--zero3-secondary-shard", "node"),
             "secondary int8": ("--zero3-secondary-shard", "node", "--zero3-quantize-weights",
                                "--zero3-quantize-grads")}
    crossed = {}
    for mode, mode_flags in modes.items():
        steps = _bytes_per_step(*flags, *mode_flags)["steps"]
        crossed[mode] = sum(steps[1].values())
    return {mode: crossed[mode] / crossed["flat"] for mode in modes}


def test_the_node_modes_cross_a_fraction_of_flat_zero3s_bytes_counted():
    """Issue #34's points, counted by the collectives' own accounting on a real run of 4
    ranks as 2 nodes x 2 (reshard after forward): the secondary shard brings at most 0.35x
    of flat ZeRO-3's bytes from the other node, with both int8 collectives at most 0.15x.
    Per unit the secondary shard brings 1/3 of flat's (one gather and a half-size reduction
    against two gathers and a reduction) where flat re-gathers in backward, 1/2 where it
    does not (the tied embedding, the last unit of forward): measured 0.342 with one
    micro-batch on six layers (0.358 on the tiny model's two: too few re-gathered units),
    0.279 with two micro-batches on two layers; 0.087 and 0.071 with int8."""
    for flags in (("--num-layers", "6"), ("--micro-batch-size", "1")):
        ratios = run_distributed(_ratios_to_flat, 4, *flags)[0]
        assert ratios["secondary"] <= 0.35, (flags, ratios)
        assert ratios["secondary int8"] <= 0.15, (flags, ratios)
