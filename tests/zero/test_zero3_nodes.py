"""The node-aware ZeRO-3 modes (hybrid sharding, the secondary shard) train the same model as
flat ZeRO-3 and one process, move across nodes only what their design says, and share the
checkpoint format with flat ZeRO-3. Four ranks with ``--gpus-per-node 2``: 2 nodes x 2."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from megatron3d.accounting import memory
from megatron3d.training.step import train_step
from megatron3d.zero.stage3 import plan as P  # noqa: N812 - the plan vocabulary
from tests.helpers.dist import run_distributed
from tests.helpers.runs import (
    assert_each_variant,
    assert_same_run,
    build,
    merge_ranks,
    reference_run,
    train,
)
from tests.helpers.tiny import train_argv
from tests.helpers.tolerances import EQUIVALENCE_FLAGS, FP32

HYBRID = ("--zero3-shard-group", "node")
SECONDARY = ("--zero3-secondary-shard", "node")
KEEP = ("--zero3-reshard-after-forward", "false")
NODES = ("--gpus-per-node", "2")
# DP 4, micro-batch 1, global batch 8: two micro-batches per rank and step.
COMMON = ("--zero-stage", "3", "--micro-batch-size", "1", "--clip-grad", "0.05",
          *EQUIVALENCE_FLAGS)
STEPS = 3


def _argv(*extra: str, steps: int = STEPS) -> list[str]:
    return train_argv("gpt2", steps, *COMMON, *extra)


class _ByAxis:
    """Collectives issued per (kind, axis name), and the tags of those over dp_inter."""

    def __init__(self) -> None:
        self.calls: Counter = Counter()
        self.bytes: Counter = Counter()

    def __call__(self, kind: str, tensor: torch.Tensor, axis, _peer=None, tag=None) -> None:
        self.calls[(kind, axis.name)] += 1
        self.bytes[(kind, axis.name)] += tensor.numel() * tensor.element_size()


def _count_steps(*flags: str) -> list[dict]:
    """Two steps of a node-aware run, the collectives of each counted by axis; its memory
    held and as the start-up line predicts it."""
    from megatron3d.mpu.traffic import observing

    trainer, state = build(_argv(*NODES, *flags))
    zero3 = trainer.model.data_parallel
    gbs = trainer.batch_schedule.global_batch_size_at(0)
    steps = []
    for step in range(2):
        counter = _ByAxis()
        with observing(counter):
            train_step(trainer.model.engine, trainer.model.optimizer,
                       trainer.data.train(step * gbs, gbs), 1e-3, trainer.model.grad_sync,
                       state.dp_cp)
        program_gathers = sum(plan.count(P.GATHER) for plan in zero3._plans.values())
        steps.append({"calls": dict(counter.calls), "bytes": dict(counter.bytes),
                      "units": len(zero3.units.groups), "gathers": program_gathers,
                      "micro_batches": gbs // state.dp_cp.size,
                      "sizes": (state.dp_intra.size, state.dp_inter.size)})
    params = list(trainer.model.engine.stage.parameters())
    return {"steps": steps, "secondary": zero3.secondary_numel, "flat": zero3.layout.numel,
            "shard": zero3.shard.numel,
            "measured": memory.measured(trainer.model.optimizer, zero3),
            "expected": memory.expected(params, 3, zero3)}


def _equal_runs() -> dict:
    """Every mode, with two micro-batches per step, reshard after forward or not; and the
    collectives per step of hybrid and the secondary shard."""
    variants = [(), (*NODES, *HYBRID), (*NODES, *SECONDARY), (*NODES, *HYBRID, *KEEP),
                (*NODES, *SECONDARY, *KEEP)]
    return {"runs": [train(_argv(*v)) for v in variants],
            "hybrid": _count_steps(*HYBRID), "secondary": _count_steps(*SECONDARY)}


def test_node_modes_equal_flat_zero3_and_one_process_and_cross_nodes_as_designed():
    per_rank = run_distributed(_equal_runs, 4, timeout_s=300)
    labels = ["flat", "hybrid", "secondary", "hybrid, kept", "secondary, kept"]
    assert_each_variant([r["runs"] for r in per_rank], reference_run(tuple(_argv())), labels,
                        FP32)
    for r in per_rank:
        for mode, shard_ways, secondary in (("hybrid", 2, 0), ("secondary", 4, 2)):
            found = r[mode]
            assert found["shard"] * shard_ways == found["flat"]  # states over k, or all D
            assert found["secondary"] * (secondary or 1) == found["flat"] * bool(secondary)
            measured, expected = found["measured"], found["expected"]
            assert abs(measured.total - expected.total) <= 0.05 * expected.total
        for step in r["hybrid"]["steps"]:  # gathers and reductions in the node, one sum across
            calls, units, m = step["calls"], step["units"], step["micro_batches"]
            assert step["sizes"] == (2, 2) and m == 2
            assert calls[("all_gather", "dp_intra")] == step["gathers"]
            assert calls[("reduce_scatter", "dp_intra")] == units * m
            assert ("all_gather", "dp_inter") not in calls
            assert ("reduce_scatter", "dp_inter") not in calls
            # the shard's sum, and the optimizer's agreement on skipping (a 4-byte flag)
            assert calls[("all_reduce", "dp_inter")] == 2
            shard_bytes = step["bytes"][("reduce_scatter", "dp_intra")] // (m * 2)
            assert step["bytes"][("all_reduce", "dp_inter")] == shard_bytes + 4
        for step in r["secondary"]["steps"]:  # the first gather of each unit crosses, no other
            calls, units, m = step["calls"], step["units"], step["micro_batches"]
            assert calls[("all_gather", "dp_inter")] == units
            assert calls[("all_gather", "dp_intra")] == step["gathers"]
            assert calls[("reduce_scatter", "dp_intra")] == units * m
            assert calls[("reduce_scatter", "dp_inter")] == units * m
            assert ("all_reduce", "dp_inter") not in calls
            intra = step["bytes"][("reduce_scatter", "dp_intra")]
            assert step["bytes"][("reduce_scatter", "dp_inter")] * 2 == intra  # 1/k


def _pipeline_runs() -> list:
    """PP 2 x DP 2 with one rank per node: each stage's replicas on two nodes."""
    layout = ("--pipeline-model-parallel-size", "2", "--pp-partition-method", "uniform",
              "--gpus-per-node", "1")
    return [train(_argv(*layout, *mode)) for mode in (HYBRID, SECONDARY)]


def test_node_modes_under_pipeline_parallelism_equal_one_process():
    per_rank = run_distributed(_pipeline_runs, 4, timeout_s=300)
    assert_each_variant(per_rank, reference_run(tuple(_argv())), ["hybrid", "secondary"],
                        FP32)


def _resumed(directory: str) -> dict:
    """4 hybrid steps; 2 hybrid steps saved; resumed in hybrid, the secondary shard, flat."""
    continuous = train(_argv(*NODES, *HYBRID, steps=4))
    train(_argv(*NODES, *HYBRID, "--save", directory, "--exit-interval", "2", steps=4))
    return {"continuous": continuous,
            **{name: train(_argv(*mode, "--load", directory, steps=4))
               for name, mode in (("hybrid", (*NODES, *HYBRID)),
                                  ("secondary", (*NODES, *SECONDARY)), ("flat", ()))}}


def test_a_hybrid_checkpoint_loads_in_every_mode(tmp_path):
    per_rank = run_distributed(_resumed, 4, str(tmp_path / "ckpt"), timeout_s=300)
    runs = {k: merge_ranks([r[k] for r in per_rank])
            for k in ("continuous", "hybrid", "secondary", "flat")}
    continuous = runs["continuous"]
    continuous.losses, continuous.grad_norms = continuous.losses[2:], continuous.grad_norms[2:]
    assert runs["hybrid"].losses == continuous.losses  # same layout: bitwise
    for name, value in continuous.params.items():
        assert torch.equal(runs["hybrid"].params[name], value), name
    for mode in ("secondary", "flat"):
        assert_same_run(runs[mode], continuous, FP32)


QUANTIZED = ("--zero3-quantize-weights", "--zero3-quantize-grads")


def _quantized_runs() -> dict:
    """Every mode with both quantizations; one step's bytes over dp_inter, with and without."""
    def inter_bytes(*flags: str) -> int:
        counted = _count_steps(*flags)["steps"][0]["bytes"]
        return sum(n for (_, axis), n in counted.items() if axis == "dp_inter")

    return {"runs": [train(_argv(*mode, *QUANTIZED)) for mode in
                     ((), (*NODES, *HYBRID), (*NODES, *SECONDARY))],
            "bytes": {mode: (inter_bytes(*flags), inter_bytes(*flags, *QUANTIZED))
                      for mode, flags in (("hybrid", HYBRID), ("secondary", SECONDARY))}}


def test_quantized_modes_train_close_to_fp32_on_a_quarter_of_the_cross_node_bytes():
    """int8 blocks of 256 (error <= absmax/254 per element): the loss of each of 3 steps
    within 0.2% of the fp32 run's (measured: 2e-4), every replica's weights identical; the
    secondary shard's cross-node bytes at 1/4 + 1/256 of fp32's (and a record's padding),
    hybrid's sum a quantized reduce-scatter (every rank's shard, int8) and all-gather (its
    chunk)."""
    per_rank = run_distributed(_quantized_runs, 4, timeout_s=300)
    reference = reference_run(tuple(_argv()))
    for index, label in enumerate(("flat", "hybrid", "secondary")):
        run = merge_ranks([r["runs"][index] for r in per_rank])  # replicas stay identical
        torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(reference.losses),
                                   rtol=2e-3, atol=0, msg=lambda m, lb=label: f"{lb}: {m}")
    for r in per_rank:
        plain, quantized = r["bytes"]["secondary"]
        assert 0.254 <= quantized / plain <= 0.27, r["bytes"]
        plain, quantized = r["bytes"]["hybrid"]
        assert quantized / plain <= 0.254 * 1.5 + 0.01, r["bytes"]  # (n + 1) / n of a record


def test_quantized_grads_refuse_a_bf16_reduction():
    from megatron3d.config import ParallelConfig
    from megatron3d.errors import ConfigError
    from megatron3d.zero.checks import check_zero

    parallel = ParallelConfig(zero_stage=3, zero3_quantize_grads=True, grad_reduce_in_bf16=True)
    with pytest.raises(ConfigError, match="--zero3-quantize-grads .* drop one"):
        check_zero(parallel, 4)
