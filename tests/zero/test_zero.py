"""ZeRO and data parallelism beyond equivalence: bf16 tracking fp32, fp16 overflow agreed
across ranks, optimizer-state bytes, and bucket reductions starting during backward (each
model chunk's, under interleaving)."""

from __future__ import annotations

import pytest
import torch

from megatron3d.accounting import memory
from megatron3d.mpu.traffic import CommCounter, observing
from megatron3d.pipeline.instructions import Backward
from megatron3d.pipeline.interleaved import interleaved_1f1b
from megatron3d.resilience.flight_recorder import FlightRecorder
from megatron3d.training.build import Overrides
from megatron3d.training.grad_sync import GradSync
from megatron3d.training.step import train_step
from megatron3d.zero.layout import param_chunks
from tests.helpers.dist import run_distributed
from tests.helpers.faults import CorruptAfterReduce
from tests.helpers.runs import build, train, train_single
from tests.helpers.tiny import train_argv

BF16_LOSS_ATOL = 0.05
"""bf16 keeps 8 mantissa bits (relative rounding ~4e-3 per operation); with fp32 master
weights and fp32 gradient reduction the per-step loss of a tiny model stays within a few
hundredths of the fp32 run over 50 steps."""


def _bf16_run(zero: int) -> list[float]:
    return train(train_argv("gpt2", 50, "--bf16", "--zero-stage", str(zero),
                            "--lr", "1e-2")).losses


@pytest.mark.parametrize("zero", [1, 3])
def test_bf16_zero_tracks_the_fp32_reference(zero):
    bf16 = run_distributed(_bf16_run, 2, zero)[1]
    fp32 = train_single(train_argv("gpt2", 50, "--lr", "1e-2")).losses
    diffs = [abs(a - b) for a, b in zip(bf16, fp32, strict=True)]
    assert max(diffs) < BF16_LOSS_ATOL, max(diffs)
    assert fp32[-1] < fp32[0] - 0.5  # the comparison is over a run that really learns


def _reduce_bytes(*flags: str) -> tuple[list[float], int]:
    losses = []
    trainer, state = build(train_argv("gpt2", 20, "--zero-stage", "1", "--lr", "1e-2", *flags),
                           on_step=lambda _it, result: losses.append(result.loss.item()))
    counter = CommCounter(only=(state.dp,))
    with observing(counter):
        trainer.run()
    return losses, counter.bytes["reduce_scatter"]


def test_grad_reduce_in_bf16_halves_dp_bytes_and_tracks_fp32_reduction():
    (fp32, fp32_bytes), _ = run_distributed(_reduce_bytes, 2)
    (bf16, bf16_bytes), _ = run_distributed(_reduce_bytes, 2, "--grad-reduce-in-bf16")
    assert bf16_bytes * 2 == fp32_bytes
    assert max(abs(a - b) for a, b in zip(bf16, fp32, strict=True)) < BF16_LOSS_ATOL
    assert bf16 != fp32  # the wire really was bf16


def _overlapped_gather() -> dict:
    trainer, state = build(train_argv("gpt2", 3, "--zero-stage", "1", "--overlap-param-gather",
                                      "--reduce-bucket-size", "2000"))
    gatherer = trainer.model.data_parallel.gatherer
    params = trainer.model.data_parallel.buffers.params
    inputs_in_place = []

    def on_collective(kind: str, tensor, axis, *_) -> None:
        if kind == "all_gather" and axis.group is state.dp.group:
            start = tensor.data_ptr() - params.data_ptr()
            inputs_in_place.append(0 <= start < params.nbytes)

    forwards: list[dict[int, set[int]]] = []  # per forward: layer -> buckets in flight

    def snapshot(j: int) -> None:
        if j == 0:
            forwards.append({})
        forwards[-1][j] = set(gatherer.pending)

    for j, layer in enumerate(trainer.model.engine.stage.layers):  # runs after the gatherer's hook
        layer.register_forward_pre_hook(lambda _m, _x, j=j: snapshot(j))
    with observing(on_collective):
        trainer.run()
    per_step = trainer.batch_schedule.global_batch_size_at(0) // (2 * state.dp.size)
    layers = trainer.model.engine.stage.layers
    buckets = trainer.model.data_parallel.buffers.layout.buckets
    first_use = {b: next(j for j, layer in enumerate(layers)  # a tied weight: layer 0
                         if any(p is q for p in layer.parameters() for q in bucket.params))
                 for b, bucket in enumerate(buckets)}
    return {"forwards": forwards, "first_use": first_use,
            "in_place": inputs_in_place, "second_step": per_step}


def test_overlapped_param_gather_waits_at_first_use_without_staging():
    for r in run_distributed(_overlapped_gather, 2):
        first_use, forwards = r["first_use"], r["forwards"]
        assert len(first_use) > 3 and r["in_place"] and all(r["in_place"])
        for pending_at in forwards:  # a bucket is always complete before its first use
            for j, pending in pending_at.items():
                assert pending <= {b for b, first in first_use.items() if first > j}, j
        # The first forward after a step: each layer waited for exactly its own buckets,
        # the later ones were still in flight.
        for j, pending in forwards[r["second_step"]].items():
            assert pending == {b for b, first in first_use.items() if first > j}, j


def _fp16_overflow(zero: int) -> dict:
    def corrupted(sync: GradSync) -> CorruptAfterReduce:
        grads = sync.data_parallel.shard.grads
        return CorruptAfterReduce(sync, lambda: grads, at=3, on_rank=sync.state.dp.rank == 1,
                                  value=float("inf"))

    seen = []
    trainer, state = build(train_argv("gpt2", 5, "--fp16", "--initial-loss-scale", "1024",
                                      "--hysteresis", "1", "--zero-stage", str(zero)),
                           Overrides(grad_sync=corrupted),
                           on_step=lambda it, r: seen.append((
                               r.stats.skipped.item(), r.stats.loss_scale,
                               trainer.model.optimizer.loss_scale)))
    trainer.run()
    dp = trainer.model.data_parallel  # ZeRO-3 ranks hold different shards: nothing to compare
    return {"steps": seen, "params": dp.buffers.params.clone() if zero < 3 else None}


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_fp16_overflow_on_one_rank_skips_the_step_everywhere(zero):
    rank0, rank1 = run_distributed(_fp16_overflow, 2, zero)
    for steps in (rank0["steps"], rank1["steps"]):
        assert [skipped for skipped, _, _ in steps] == [0.0, 0.0, 1.0, 0.0, 0.0]
        assert steps[2][1] == 1024.0 and steps[2][2] == 512.0  # lowered after the overflow
        assert steps[3][1] == 512.0
    if zero < 3:
        assert torch.equal(rank0["params"], rank1["params"])  # replicas stayed identical


def _state_bytes(zero: int) -> tuple[int, int]:
    trainer, state = build(train_argv("gpt2", 3, "--bf16", "--zero-stage", str(zero),
                                         "--reduce-bucket-size", "3000"))
    trainer.run()
    params = sum(p.numel() for p in trainer.model.engine.stage.parameters())
    expected = memory.analytic(params, 2, zero, state.dp.size).optimizer_state
    return trainer.model.optimizer.state_bytes(), expected


@pytest.mark.parametrize("dp", [2, 4])
def test_zero1_optimizer_state_bytes_match_the_analytic_value(dp):
    for measured, expected in run_distributed(_state_bytes, dp, 1):
        assert abs(measured - expected) <= 0.01 * expected, (measured, expected)
    (full, full_expected), *_ = run_distributed(_state_bytes, dp, 0)
    assert full == full_expected  # ZeRO-0: every rank holds all 12 bytes per parameter


def _launch_points() -> tuple[int, int, int]:
    trainer, state = build(train_argv("gpt2", 3, "--reduce-bucket-size", "2000"))
    batches = trainer.data.train(0, trainer.batch_schedule.global_batch_size_at(0))
    trainer.model.optimizer.zero_grad()
    trainer.model.engine.forward_backward(
        batches, 1.0, before_last_backward=trainer.model.grad_sync.before_last_backward)
    during_backward = len(trainer.model.data_parallel.reducer.launched)
    trainer.model.grad_sync()
    return during_backward, len(trainer.model.data_parallel.buffers.layout.buckets), len(batches)


def test_bucket_reductions_start_during_the_last_backward():
    for during_backward, buckets, micro_batches in run_distributed(_launch_points, 2):
        assert buckets > 3 and micro_batches > 1
        assert during_backward == buckets  # every bucket was launched from a grad hook


def _bucket_issue_points(zero: int) -> dict:
    """One interleaved step (PP=2 x v=2, DP=2, 4 micro-batches) under the flight recorder:
    the program step during which each bucket's reduction was issued (None: after the
    program), each bucket's chunks and each chunk's last backward."""
    recorder = FlightRecorder(4096)
    trainer, state = build(train_argv("gpt2", 3, "--num-layers", "4", "--micro-batch-size", "1",
                                      "--pipeline-model-parallel-size", "2",
                                      "--virtual-pipeline-model-parallel-size", "2",
                                      "--zero-stage", str(zero), "--reduce-bucket-size", "2000"),
                           Overrides(observers=(recorder,)))
    batches = trainer.data.train(0, trainer.batch_schedule.global_batch_size_at(0))
    with observing(recorder):
        train_step(trainer.model.engine, trainer.model.optimizer, batches, 1e-3,
                   trainer.model.grad_sync, state.dp)
    kind = "reduce_scatter" if zero == 1 else "all_reduce"
    issued = [(op.tag[1], op.step) for op in recorder.ops
              if op.group == "dp" and op.kind == kind and op.tag and op.tag[0] == "bucket"]
    engine = trainer.model.engine
    chunks = param_chunks(engine.stage.layers, tuple(len(c.layers) for c in engine.chunks))
    buckets = trainer.model.data_parallel.buffers.layout.buckets
    program = interleaved_1f1b(state.pp.size, state.pp.rank, len(batches), len(engine.chunks))
    return {"issued": issued, "last_backward": {s.chunk: i for i, s in enumerate(program)
                                                if isinstance(s, Backward)},
            "chunks": [set().union(*(chunks[id(p)] for p in b.params)) for b in buckets]}


def test_interleaved_buckets_are_reduced_during_each_chunks_last_backward():
    """Every chunk's buckets are issued from its last backward, which for all but one chunk
    is before the step's last backward begins: the reductions overlap the backward work
    still to run instead of waiting for the end of the step."""
    for zero in (0, 1):
        for r in run_distributed(_bucket_issue_points, 4, zero):
            chunks, last, issued = r["chunks"], r["last_backward"], dict(r["issued"])
            assert len(r["issued"]) == len(issued) == len(chunks) > 4  # each bucket once
            assert all(len(c) == 1 for c in chunks)  # no bucket mixes two chunks
            assert set().union(*chunks) == {0, 1}
            for bucket, step in issued.items():
                (chunk,) = chunks[bucket]
                assert step == last[chunk], (zero, bucket, chunk, step, last)
            assert any(step < max(last.values()) for step in issued.values())
