"""Run pretrain_gpt's trainer inside a test (one process or one rank of many) and return
what the equivalence tests compare: per-step losses and grad norms, final logical params."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch

from megatron3d.checkpoint.loading import with_checkpoint_args
from megatron3d.cli.arguments import parse_given
from megatron3d.mpu.meta import get_meta
from megatron3d.mpu.sharding import gather_logical
from megatron3d.mpu.state import ParallelState
from megatron3d.training.build import Overrides, build_trainer
from megatron3d.training.evaluate import evaluate
from megatron3d.training.loop import Trainer
from megatron3d.validation import validate
from tests.helpers.device import rank_device


@dataclass
class RunResult:
    losses: list[float]  # meaningful on the last pipeline stage
    grad_norms: list[float]
    params: dict[str, torch.Tensor]  # this stage's parameters: logical name -> logical value
    # after training, one validation batch (meaningful on the last stage); None when the
    # run's --eval-iters is 0 (under --compile an evaluation compiles graphs of its own)
    eval_loss: float | None
    last_stage: bool = True


def build(argv: list[str], overrides: Overrides | None = None, *,
          directed_links: bool | None = None, **hooks: Any) -> tuple[Trainer, ParallelState]:
    """The trainer ``pretrain_gpt.py argv`` would run, on the initialised process group;
    ``hooks`` (``on_step=...``) are the trainer's ``Hooks``, ``overrides`` the rest;
    ``directed_links`` as ``ParallelState.build`` takes it."""
    parsed, _, given = parse_given(argv)
    cfg, _ = with_checkpoint_args(parsed, given)
    validate(cfg, torch.distributed.get_world_size())
    state = ParallelState.for_config(cfg.parallel, directed_links=directed_links)
    given = overrides or Overrides()
    if hooks:
        given = dataclasses.replace(given, hooks=dataclasses.replace(given.hooks, **hooks))
    return build_trainer(cfg, state, rank_device(), overrides=given), state


def train(argv: list[str], *, directed_links: bool | None = None,
          overrides: Overrides | None = None) -> RunResult:
    """Train with ``argv`` on the already-initialised process group (all ranks call this);
    ``overrides``' own ``on_step`` is called after this function's recording."""
    losses, norms = [], []
    also = overrides.hooks.on_step if overrides else None

    def record(iteration: int, result) -> None:
        losses.append(result.loss)
        norms.append(result.stats.grad_norm)
        if also is not None:
            also(iteration, result)

    trainer, state = build(argv, overrides, directed_links=directed_links, on_step=record)
    trainer.run()
    params = {}

    def grab(group: list) -> None:  # under ZeRO-3, one gathered unit at a time
        params.update((get_meta(p).name, gather_logical(p, state.tp).to("cpu", copy=True))
                      for p in group)

    trainer.model.data_parallel.materialize(grab)
    eval_loss = (evaluate(trainer.model.engine, trainer.data.valid, 1, state.dp_cp)
                 if trainer.cfg.training.eval_iters else None)
    return RunResult([x.item() for x in losses], [x.item() for x in norms], params, eval_loss,
                     last_stage=state.is_last_stage)


@functools.cache
def reference_run(argv: tuple[str, ...]) -> RunResult:
    """``train_single``, computed once per command line (several tests compare with it)."""
    return train_single(list(argv))


def train_single(argv: list[str]) -> RunResult:
    """The single-process reference, in this process."""
    from megatron3d import device as devices

    devices.init_process_group(devices.LaunchEnv(0, 1, 0, launched=False))
    try:
        return train(argv)
    finally:
        torch.distributed.destroy_process_group()


def merge_ranks(results: list[RunResult]) -> RunResult:
    """One run from every rank's view: the last stage's losses, all stages' parameters.
    Copies of one logical parameter on several ranks (TP replicas, tied embeddings, DP
    replicas) must be bitwise identical."""
    last = next(r for r in results if r.last_stage)
    params: dict[str, torch.Tensor] = {}
    for rank, result in enumerate(results):
        assert result.grad_norms == last.grad_norms, f"rank {rank} sees another grad norm"
        for name, value in result.params.items():
            if name in params:
                assert torch.equal(params[name], value), f"copies of {name} differ (rank {rank})"
            params[name] = value
    return RunResult(last.losses, last.grad_norms, params, last.eval_loss)


def assert_same_run(actual: RunResult, expected: RunResult, tol: dict) -> None:
    torch.testing.assert_close(torch.tensor(actual.losses), torch.tensor(expected.losses), **tol)
    torch.testing.assert_close(torch.tensor(actual.grad_norms),
                               torch.tensor(expected.grad_norms), **tol)
    assert (actual.eval_loss is None) == (expected.eval_loss is None), "one run evaluated"
    if expected.eval_loss is not None:
        torch.testing.assert_close(torch.tensor(actual.eval_loss),
                                   torch.tensor(expected.eval_loss), **tol)
    assert actual.params.keys() == expected.params.keys()
    for name, value in expected.params.items():
        torch.testing.assert_close(actual.params[name], value, **tol,
                                   msg=lambda m, n=name: f"{n}: {m}")


def assert_each_variant(per_rank: list[list[RunResult]], reference: RunResult,
                        labels: list[str], tol: dict) -> None:
    """Every rank ran the same variants in order; each, merged over ranks, must match
    ``reference`` (the failure names the variant by its label)."""
    for index, label in enumerate(labels):
        merged = merge_ranks([results[index] for results in per_rank])
        try:
            assert_same_run(merged, reference, tol)
        except AssertionError as err:
            raise AssertionError(f"{label}: {err}") from err


def learning_rates(argv: list[str]) -> list[float]:
    """The learning rate each iteration of ``pretrain_gpt.py argv`` applied, in one process
    (logging re-attached to this test's output, as ``pretrain_gpt.main`` does)."""
    from megatron3d import device as devices
    from megatron3d.log import setup_logging

    setup_logging(0, log_rank=0)
    devices.init_process_group(devices.LaunchEnv(0, 1, 0, launched=False))
    try:
        used: list[float] = []
        trainer, _ = build(argv, on_step=lambda it, result: used.append(
            trainer.model.optimizer.inner.param_groups[0]["lr"]))
        trainer.run()
    finally:
        torch.distributed.destroy_process_group()
    return used
