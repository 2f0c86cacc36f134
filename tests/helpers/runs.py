"""Run pretrain_gpt's trainer inside a test (one process or one rank of many) and return
what the equivalence tests compare: per-step losses and grad norms, final logical params."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron3d.arguments import parse_args
from megatron3d.mpu.meta import get_meta
from megatron3d.mpu.sharding import gather_logical
from megatron3d.mpu.state import ParallelState
from megatron3d.training.build import build_trainer
from megatron3d.validation import validate


@dataclass
class RunResult:
    losses: list[float]
    grad_norms: list[float]
    params: dict[str, torch.Tensor]  # logical name -> full logical value


def train(argv: list[str]) -> RunResult:
    """Train with ``argv`` on the already-initialised process group (all ranks call this)."""
    world = torch.distributed.get_world_size()
    cfg = parse_args(argv)
    validate(cfg, world)
    state = ParallelState.build(cfg.parallel.tensor_model_parallel_size,
                                cfg.parallel.pipeline_model_parallel_size)
    trainer = build_trainer(cfg, state, torch.device("cpu"))
    losses, norms = [], []

    def record(_: int, result) -> None:
        losses.append(result.loss)
        norms.append(result.stats.grad_norm)

    trainer.on_step = record
    trainer.run()
    params = {get_meta(p).name: gather_logical(p, state.tp).clone()
              for p in trainer.model.parameters()}
    return RunResult([x.item() for x in losses], [x.item() for x in norms], params)


def train_single(argv: list[str]) -> RunResult:
    """The single-process reference, in this process."""
    from megatron3d import device as devices

    devices.init_process_group(devices.LaunchEnv(0, 1, 0, launched=False))
    try:
        return train(argv)
    finally:
        torch.distributed.destroy_process_group()


def assert_same_run(actual: RunResult, expected: RunResult, tol: dict) -> None:
    torch.testing.assert_close(torch.tensor(actual.losses), torch.tensor(expected.losses), **tol)
    torch.testing.assert_close(torch.tensor(actual.grad_norms),
                               torch.tensor(expected.grad_norms), **tol)
    assert actual.params.keys() == expected.params.keys()
    for name, value in expected.params.items():
        torch.testing.assert_close(actual.params[name], value, **tol,
                                   msg=lambda m, n=name: f"{n}: {m}")
