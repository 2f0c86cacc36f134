"""ZeRO and data parallelism beyond equivalence: bf16 tracking fp32, fp16 overflow agreed
across ranks, optimizer-state bytes, and bucket reductions starting during backward."""

from __future__ import annotations

import pytest
import torch

from megatron3d.arguments import parse_args
from megatron3d.mpu.state import ParallelState
from megatron3d.training import memory
from megatron3d.training.build import build_trainer
from megatron3d.validation import validate
from tests.helpers.dist import run_distributed
from tests.helpers.runs import train, train_single
from tests.helpers.tiny import train_argv

BF16_LOSS_ATOL = 0.05
"""bf16 keeps 8 mantissa bits (relative rounding ~4e-3 per operation); with fp32 master
weights and fp32 gradient reduction the per-step loss of a tiny model stays within a few
hundredths of the fp32 run over 50 steps."""


def _trainer(argv: list[str]):
    cfg = parse_args(argv)
    validate(cfg, torch.distributed.get_world_size())
    state = ParallelState.build(cfg.parallel.tensor_model_parallel_size,
                                cfg.parallel.pipeline_model_parallel_size)
    return build_trainer(cfg, state, torch.device("cpu")), state


def _bf16_run() -> list[float]:
    return train(train_argv("gpt2", 50, "--bf16", "--zero-stage", "1",
                            "--lr", "1e-2")).losses


def test_bf16_zero1_tracks_the_fp32_reference():
    bf16 = run_distributed(_bf16_run, 2)[1]
    fp32 = train_single(train_argv("gpt2", 50, "--lr", "1e-2")).losses
    diffs = [abs(a - b) for a, b in zip(bf16, fp32, strict=True)]
    assert max(diffs) < BF16_LOSS_ATOL, max(diffs)
    assert fp32[-1] < fp32[0] - 0.5  # the comparison is over a run that really learns


class _InjectOverflow:
    """Wraps the trainer's GradSync: after the reduction of step ``at``, one rank's gradient
    becomes inf (an overflow only that rank sees)."""

    def __init__(self, inner, optimizer, at: int, on_rank: bool) -> None:
        self.inner, self.optimizer, self.at, self.on_rank = inner, optimizer, at, on_rank
        self.calls = 0

    def before_last_backward(self) -> None:
        self.inner.before_last_backward()

    def __call__(self) -> None:
        self.inner()
        self.calls += 1
        if self.calls == self.at and self.on_rank:
            self.optimizer.shard.grads[0] = float("inf")


def _fp16_overflow(zero: int) -> dict:
    trainer, state = _trainer(train_argv("gpt2", 5, "--fp16", "--initial-loss-scale", "1024",
                                         "--hysteresis", "1", "--zero-stage", str(zero)))
    trainer.grad_sync = _InjectOverflow(trainer.grad_sync, trainer.optimizer, at=3,
                                        on_rank=state.dp.rank == 1)
    seen = []
    trainer.on_step = lambda it, r: seen.append((r.stats.skipped.item(), r.stats.loss_scale,
                                                 trainer.optimizer.loss_scale))
    trainer.run()
    return {"steps": seen, "params": trainer.data_parallel.buffers.params.clone()}


@pytest.mark.parametrize("zero", [0, 1])
def test_fp16_overflow_on_one_rank_skips_the_step_everywhere(zero):
    rank0, rank1 = run_distributed(_fp16_overflow, 2, zero)
    for steps in (rank0["steps"], rank1["steps"]):
        assert [skipped for skipped, _, _ in steps] == [0.0, 0.0, 1.0, 0.0, 0.0]
        assert steps[2][1] == 1024.0 and steps[2][2] == 512.0  # lowered after the overflow
        assert steps[3][1] == 512.0
    assert torch.equal(rank0["params"], rank1["params"])  # replicas stayed identical


def _state_bytes(zero: int) -> tuple[int, int]:
    trainer, state = _trainer(train_argv("gpt2", 3, "--bf16", "--zero-stage", str(zero),
                                         "--reduce-bucket-size", "3000"))
    trainer.run()
    params = sum(p.numel() for p in trainer.engine.stage.parameters())
    expected = memory.analytic(params, 2, zero, state.dp.size).optimizer_state
    return trainer.optimizer.state_bytes(), expected


@pytest.mark.parametrize("dp", [2, 4])
def test_zero1_optimizer_state_bytes_match_the_analytic_value(dp):
    for measured, expected in run_distributed(_state_bytes, dp, 1):
        assert abs(measured - expected) <= 0.01 * expected, (measured, expected)
    (full, full_expected), *_ = run_distributed(_state_bytes, dp, 0)
    assert full == full_expected  # ZeRO-0: every rank holds all 12 bytes per parameter


def _launch_points() -> tuple[int, int, int]:
    trainer, state = _trainer(train_argv("gpt2", 3, "--reduce-bucket-size", "2000"))
    batches = trainer.train_batches(0, trainer.batch_schedule.global_batch_size_at(0))
    trainer.optimizer.zero_grad()
    trainer.engine.forward_backward(batches, 1.0,
                                    before_last_backward=trainer.grad_sync.before_last_backward)
    during_backward = len(trainer.data_parallel.reducer.launched)
    trainer.grad_sync()
    return during_backward, len(trainer.data_parallel.buffers.layout.buckets), len(batches)


def test_bucket_reductions_start_during_the_last_backward():
    for during_backward, buckets, micro_batches in run_distributed(_launch_points, 2):
        assert buckets > 3 and micro_batches > 1
        assert during_backward == buckets  # every bucket was launched from a grad hook
