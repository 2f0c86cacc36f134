"""ZeRO-3 beyond equivalence: the plan's invariants, collectives per step, real prefetch,
and resident memory at the analytic value with buffers allocated once."""

from __future__ import annotations

import pytest
import torch

from megatron3d.accounting import memory
from megatron3d.mpu.traffic import CommCounter, observing
from megatron3d.pipeline.schedule import schedule_for
from megatron3d.training.step import train_step
from megatron3d.zero.stage3 import plan as P  # noqa: N812 - the plan vocabulary, P.GATHER etc.
from megatron3d.zero.stage3.runtime import _assign_slots
from tests.helpers.dist import run_distributed
from tests.helpers.runs import build
from tests.helpers.tiny import train_argv

# gpt2 with 4 layers at PP=1: units tied word embedding, position embedding, 4 blocks, final
# norm (the head has no weight of its own: it is the tied embedding).
NEEDS = ((0, 1), (2,), (3,), (4,), (5,), (6,), (0,))


def _replay(plan: P.Plan, slot_of: dict[int, int]) -> dict[str, int]:
    """Walk a plan as the runtime does, checking it never overwrites a resident unit and
    never computes with a unit that is not gathered and awaited."""
    occupant: dict[int, int] = {}
    ready: set[int] = set()
    counts = {kind: 0 for kind in (P.GATHER, P.REDUCE)}
    for point in plan.points:
        for op in point.ops:
            slot = slot_of[op.unit]
            if op.kind == P.GATHER:
                assert slot not in occupant, f"{op}: slot holds unit {occupant.get(slot)}"
                occupant[slot] = op.unit
            elif op.kind == P.WAIT:
                assert occupant.get(slot) == op.unit
                ready.add(op.unit)
            elif op.kind == P.RELEASE:
                assert occupant.pop(slot) == op.unit
                ready.discard(op.unit)
            counts[op.kind] = counts.get(op.kind, 0) + 1
        if point.trigger[0] == "pre":
            assert all(u in ready for u in NEEDS[point.trigger[1]]), point
    assert not occupant, "every unit is released by the end of the program"
    _check_gradients(plan)
    return counts


def _check_gradients(plan: P.Plan) -> None:
    """Every backward use of a unit lies between the zeroing of its gradients and their
    reduction, with as many backward passes in between as the plan says."""
    open_grads: dict[int, set[int]] = {}  # unit -> backward passes since its zeroing
    passes = 0  # backward instructions begun
    for point in plan.points:
        for op in point.ops:
            if op.kind == P.GRADS:
                assert op.unit not in open_grads, f"{op}: zeroed again before its reduction"
                open_grads[op.unit] = set()
            elif op.kind == P.REDUCE:
                assert len(open_grads.pop(op.unit)) == plan.passes[op.unit], op
        if point.trigger[0] == "pre" and point.trigger[2]:
            for u in NEEDS[point.trigger[1]]:
                open_grads[u].add(passes)  # KeyError: a backward outside zeroing..reduction
        passes += point.trigger == ("tail",)
    assert not open_grads, "every unit's gradients are reduced by the end of the program"


@pytest.mark.parametrize("pp_rank", [0, 1])
@pytest.mark.parametrize("depth", [0, 1, 2])
@pytest.mark.parametrize("live", [1, 3, 5])
def test_plans_are_safe_and_within_the_gather_budget(depth, live, pp_rank):
    micro_batches = 4
    program = schedule_for("1f1b", 2, pp_rank, micro_batches)
    pinned = frozenset({0})
    slot_of = _assign_slots(len(set(u for n in NEEDS for u in n)), pinned, max(live, depth + 1))
    counts = _replay(P.build_plan(program, NEEDS, slot_of, pinned, depth), slot_of)
    pooled = len(slot_of) - 1
    assert counts[P.GATHER] <= 2 * pooled * micro_batches + 1
    assert counts[P.REDUCE] == (pooled + 1) * micro_batches
    everything = frozenset(slot_of)
    own = {u: u for u in everything}  # reshard-after-forward false: a slot per unit
    kept = _replay(P.build_plan(program, NEEDS, own, everything, depth, (), everything), own)
    assert kept[P.GATHER] == len(everything)  # one gather per unit per step
    assert kept[P.REDUCE] == len(everything)  # one reduce-scatter per unit per step


def test_prefetch_issues_gathers_ahead_of_the_computation():
    program = schedule_for("1f1b", 1, 0, 1)
    slot_of = _assign_slots(7, frozenset({0}), 3)
    plan = P.build_plan(program, NEEDS, slot_of, frozenset({0}), depth=1)
    pre = [i for i, p in enumerate(plan.points) if p.trigger[:1] == ("pre",)]
    # The unit of layer j + 1 is gathered at or before the point before layer j.
    for j in range(len(NEEDS) - 1):
        gathered = {op.unit for p in plan.points[:pre[j] + 1] for op in p.ops
                    if op.kind == P.GATHER}
        assert set(NEEDS[j + 1]) <= gathered, j


def _step_collectives(*flags: str) -> dict:
    trainer, state = build(train_argv("gpt2", 3, "--zero-stage", "3", "--micro-batch-size",
                                      "1", *flags))
    counter = CommCounter(only=(state.dp,))
    gbs = trainer.batch_schedule.global_batch_size_at(0)
    batches = trainer.data.train(0, gbs)
    with observing(counter):
        train_step(trainer.model.engine, trainer.model.optimizer, batches, 1e-3,
                   trainer.model.grad_sync, state.dp)
    units = len(trainer.model.data_parallel.units.groups)
    params = sum(p.numel() for p in trainer.model.engine.stage.parameters())
    return {"calls": dict(counter.calls), "bytes": dict(counter.bytes), "units": units,
            "micro_batches": len(batches), "params": params, "dp": state.dp.size}


@pytest.mark.parametrize("keep", [False, True])
def test_collectives_per_step(keep):
    flags = ("--zero3-reshard-after-forward", "false") if keep else ()
    for r in run_distributed(_step_collectives, 2, *flags):
        n, m, dp = r["units"], r["micro_batches"], r["dp"]
        assert m >= 4
        gathers, reduces = r["calls"]["all_gather"], r["calls"]["reduce_scatter"]
        if keep:
            assert gathers == n  # one gather per unit per step
            theory = r["params"] * 4 / dp  # every parameter gathered once, fp32
            assert abs(r["bytes"]["all_gather"] - theory) <= 0.05 * theory
            assert reduces == n  # ONE reduce-scatter per unit per step
        else:
            assert gathers <= 2 * n * m
            assert reduces == n * m  # ONE reduce-scatter per unit per micro-batch
        theory = (1 if keep else m) * r["params"] * 4  # each reduction: every gradient once
        assert abs(r["bytes"]["reduce_scatter"] - theory) <= 0.05 * theory
        assert set(r["calls"]) <= {"all_gather", "reduce_scatter", "all_reduce"}
        assert r["calls"].get("all_reduce", 0) <= 3  # loss average and grad norm


def _gather_and_compute_order(depth: int) -> tuple[list[str], tuple]:
    trainer, state = build(train_argv("gpt2", 3, "--zero-stage", "3", "--num-layers", "4",
                                      "--zero3-prefetch-depth", str(depth)))
    events: list[str] = []
    for j, layer in enumerate(trainer.model.engine.stage.layers):  # after ZeRO-3's own hooks
        layer.register_forward_pre_hook(lambda _m, _x, j=j: events.append(f"compute {j}"))

    def on_collective(kind: str, _tensor, axis, *_) -> None:
        if kind == "all_gather" and axis.group is state.dp.group:
            events.append("gather")

    batches = trainer.data.train(0, trainer.batch_schedule.global_batch_size_at(0))
    with observing(on_collective), torch.no_grad():
        trainer.model.engine.forward_only(batches[:1])
    return events, trainer.model.data_parallel.units.needs


def test_prefetch_is_real():
    """Depth 1: the gather for layer k + 1 is issued before layer k starts computing; depth 0
    gathers each layer's unit only just before it runs."""
    (eager, needs), (lazy, _) = (run_distributed(_gather_and_compute_order, 2, depth)[0]
                                 for depth in (1, 0))
    for k in range(len(needs) - 1):
        this_and_next = len(set().union(*needs[:k + 2]))  # units of layers 0..k+1
        before = eager[:eager.index(f"compute {k}")]
        assert before.count("gather") == this_and_next, (k, eager)
        lazy_before = lazy[:lazy.index(f"compute {k}")]
        assert lazy_before.count("gather") == len(set().union(*needs[:k + 1])), (k, lazy)


def _memory(*flags: str) -> dict:
    pointers = []

    def snapshot(_it, _result) -> None:
        dp = trainer.model.data_parallel
        tensors = [dp.shard.local_params, dp.shard.grads,
                   *(t for s in dp.slots for t in (s.params, s.grads))]
        pointers.append(([t.data_ptr() for t in tensors],
                         memory.measured(trainer.model.optimizer, dp)))

    trainer, state = build(train_argv("gpt2", 4, "--zero-stage", "3", *flags), on_step=snapshot)
    trainer.run()
    params = list(trainer.model.engine.stage.parameters())
    expected = memory.analytic(sum(p.numel() for p in params), params[0].element_size(), 3,
                               state.dp.size, memory.live_numel(trainer.model.data_parallel))
    return {"steps": pointers, "expected": expected}


@pytest.mark.parametrize("flags", [(), ("--bf16",)], ids=["fp32", "bf16"])
def test_resident_bytes_match_the_analytic_value_and_buffers_are_allocated_once(flags):
    for r in run_distributed(_memory, 2, *flags):
        expected = r["expected"]
        steps = r["steps"]
        for (pointers, measured) in steps[1:]:
            assert pointers == steps[1][0] and measured == steps[1][1]  # nothing reallocated
        measured = steps[-1][1]
        total = measured.params + measured.grads + measured.optimizer_state
        theory = expected.params + expected.grads + expected.optimizer_state
        assert abs(total - theory) <= 0.05 * theory, (measured, expected)
        assert measured.optimizer_state <= 1.05 * expected.optimizer_state
