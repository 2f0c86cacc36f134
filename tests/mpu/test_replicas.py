"""The TP replica check: silent on a fresh TP model, loud on every rank when one replicated
parameter drifts on one rank, blind to TP-split parameters (they differ by design), and run by
the trainer every ``--check-replicas-interval`` steps.

Each distributed scenario runs in one spawn (world 2, TP 2) and returns every check's verdict,
so the assertions below see both ranks' messages.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron3d import device as devices
from megatron3d.checkpoint.progress import Progress
from megatron3d.cli.arguments import parse_args
from megatron3d.model.gpt import build_gpt
from megatron3d.mpu.meta import get_meta
from megatron3d.mpu.replicas import ReplicaDriftError, check_tp_replicas
from megatron3d.mpu.state import AxisGroup, ParallelState
from megatron3d.training.build import Overrides, build_trainer
from megatron3d.training.loop import Hooks, Trainer
from megatron3d.training.step import StepResult
from megatron3d.validation import validate
from tests.helpers.dist import run_distributed
from tests.helpers.tiny import layer_context, model_config, train_argv

# Replicated across TP: a norm weight, a row-parallel layer's bias, the position table.
REPLICATED = ("layers.0.input_norm.weight", "layers.1.mlp.fc2.bias",
              "embedding.position_embeddings.weight")
SPLIT = "layers.0.attention.qkv.weight"  # column-parallel: each TP rank holds its own rows
DRIFT_RANK = 1


def _verdict(params: list[nn.Parameter], tp: AxisGroup) -> str | None:
    """None if the replicas agree, else the ReplicaDriftError message this rank got."""
    try:
        check_tp_replicas([(p, p.detach()) for p in params], tp)
    except ReplicaDriftError as err:
        return str(err)
    return None


def _nudge(param: nn.Parameter) -> None:
    """Move one element by one ulp: the smallest drift there is, which a bitwise check sees."""
    with torch.no_grad():
        flat = param.view(-1)
        flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf")))


def _replica_scenarios() -> dict[str, str | None]:
    state = ParallelState.build(2, 1)
    model = build_gpt(layer_context(model_config("gpt2"), tp=state.tp))
    params = list(model.parameters())
    named = {get_meta(p).name: p for p in params}
    verdicts = {"fresh": _verdict(params, state.tp)}
    for name in (*REPLICATED, SPLIT):
        saved = named[name].detach().clone()
        if state.tp.rank == DRIFT_RANK:
            _nudge(named[name])
        verdicts[name] = _verdict(params, state.tp)
        with torch.no_grad():
            named[name].copy_(saved)
        verdicts[f"{name} restored"] = _verdict(params, state.tp)
    return verdicts


def test_check_tp_replicas_on_a_tp2_gpt():
    rank0, rank1 = run_distributed(_replica_scenarios, 2)
    for verdicts in (rank0, rank1):
        assert verdicts["fresh"] is None, verdicts["fresh"]
        for name in (*REPLICATED, SPLIT):
            assert verdicts[f"{name} restored"] is None, verdicts[f"{name} restored"]
        # A TP-split parameter is different on each rank anyway; changing it is no drift.
        assert verdicts[SPLIT] is None, verdicts[SPLIT]
    for name in REPLICATED:
        # Both ranks raise, so neither trains on alone, and both name the drifted parameter.
        others = [n for n in REPLICATED if n != name]
        for message in (rank0[name], rank1[name]):
            assert message is not None and name in message, (name, message)
            assert not any(n in message for n in others), message


def _local_model(trainer: Trainer) -> nn.Module:
    return trainer.model.engine.stage


def _train_until_drift(argv: list[str], drift_after: int) -> tuple[list[int], str | None]:
    """Train with TP=2; after step ``drift_after`` nudge a norm weight on TP rank 1 only.

    Returns the iterations that completed (``on_step`` runs before the replica check of the
    same iteration) and the ReplicaDriftError message, if the loop raised one.
    """
    cfg = parse_args(argv)
    validate(cfg, 2)
    state = ParallelState.build(2, 1)
    seen: list[int] = []

    def on_step(iteration: int, _: StepResult) -> None:
        seen.append(iteration)
        if iteration == drift_after and state.tp.rank == DRIFT_RANK:
            _nudge(norm)

    trainer = build_trainer(cfg, state, torch.device("cpu"),
                            overrides=Overrides(hooks=Hooks(on_step=on_step)))
    norm = next(p for p in _local_model(trainer).parameters()
                if get_meta(p).name == REPLICATED[0])
    try:
        trainer.run()
    except ReplicaDriftError as err:
        return seen, str(err)
    return seen, None


def test_trainer_checks_replicas_every_interval():
    """Drift after step 3 with --check-replicas-interval 2: steps 1-3 pass silently (the check
    at step 2 sees agreeing replicas, step 3 has no check) and step 4's check stops the run on
    both ranks, before step 5."""
    argv = train_argv("gpt2", 6, "--tensor-model-parallel-size", "2",
                      "--check-replicas-interval", "2")
    rank0, rank1 = run_distributed(_train_until_drift, 2, argv, 3)
    for seen, message in (rank0, rank1):
        assert seen == [1, 2, 3, 4]
        assert message is not None
    assert REPLICATED[0] in rank1[1]


class _CountingCheck:
    """Stands in for the replica check: records the iteration at which it is called."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.calls: list[int] = []

    def __call__(self) -> None:
        self.calls.append(self.progress.iteration)


def _check_calls(interval: int, iters: int) -> list[int]:
    """Iterations at which a one-process trainer calls its replica check."""
    cfg = parse_args(train_argv("gpt2", iters, "--check-replicas-interval", str(interval)))
    validate(cfg, 1)
    devices.init_process_group(devices.LaunchEnv(0, 1, 0, launched=False))
    try:
        progress = Progress()
        check = _CountingCheck(progress)
        trainer = build_trainer(cfg, ParallelState.single(), torch.device("cpu"),
                                overrides=Overrides(progress=progress,
                                                    check_replicas=lambda _built: check))
        trainer.run()
        return check.calls
    finally:
        torch.distributed.destroy_process_group()


def test_replica_check_cadence():
    assert _check_calls(2, 7) == [2, 4, 6]
    assert _check_calls(3, 7) == [3, 6]
    assert _check_calls(0, 4) == []  # 0: only the check at build time
