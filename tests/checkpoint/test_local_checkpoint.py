"""Non-persistent checkpoints on 4 gloo ranks: a run that fails is resumed by a fresh
trainer from the newest local state, bitwise as if it never stopped: from a rank's own copy,
from its peer's replica when its own is gone or damaged (sent point-to-point when the rank
cannot see the replica, as across nodes), or from the global checkpoint with one notice when
both copies of a state are gone. A run that ends normally leaves no store behind."""

from __future__ import annotations

import dataclasses
import logging
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron3d.checkpoint.local import store
from megatron3d.checkpoint.local.link import peer_of
from megatron3d.training.build import Overrides
from tests.helpers.dist import run_distributed
from tests.helpers.runs import RunResult, build, merge_ranks, train
from tests.helpers.tiny import train_argv

ITERS, CRASH = 6, 4  # the failure meets step 4 before its local save: step 3 is the newest
ZERO1_PP2_DP2 = ("--pipeline-model-parallel-size", "2", "--zero-stage", "1",
                 "--pp-partition-method", "uniform")
ZERO3_TP2_DP2 = ("--tensor-model-parallel-size", "2", "--zero-stage", "3")
WORLD = 4


class _FailureError(Exception):
    """Stands for a rank's death: raised on every rank after step ``CRASH``."""


def _argv(root: str, layout: tuple[str, ...], *extra: str) -> list[str]:
    return train_argv("gpt2", ITERS, *layout, "--hidden-dropout", "0.1",
                      "--non-persistent-save-interval", "1", "--non-persistent-ckpt-type",
                      "memory", "--non-persistent-local-ckpt-dir", root, *extra)


def _fail(argv: list[str]) -> None:
    """Train until step ``CRASH`` finishes, then fail with the last local save complete."""
    def on_step(it: int, _) -> None:
        if it == CRASH:
            trainer.local_save.wait()
            raise _FailureError

    trainer, _ = build(argv, on_step=on_step)
    with pytest.raises(_FailureError):
        trainer.run()


def _alone(rank: int) -> Overrides:
    """Each rank sees only its own directory, as if every rank were on a node of its own."""
    return Overrides(local=lambda local: dataclasses.replace(
        local, sees=lambda root: store.listed(root, only=rank)))


def _resume(argv: list[str], overrides: Overrides | None = None) -> tuple[RunResult, list]:
    """``train(argv)`` (which restores), with the restore's log lines."""
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    log = logging.getLogger("megatron3d.checkpoint.local.restore")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        return train(argv, overrides=overrides), lines
    finally:
        log.removeHandler(handler)


def _scenarios(root: str, layout: tuple[str, ...], scenarios: tuple[str, ...]) -> dict:
    rank = dist.get_rank()
    runs = {"continuous": train(_argv(f"{root}/continuous", layout))}
    runs["ended_clean"] = not any(Path(f"{root}/continuous").glob("*/rank*"))
    for name in scenarios:
        where = f"{root}/{name}"
        argv = _argv(where, layout, *(("--save", f"{where}/global", "--save-interval", "2",
                                       "--load", f"{where}/global") if name == "both_lost"
                                     else ()))
        _fail(argv)
        dist.barrier()
        base = next(Path(where).glob("megatron3d-*"))
        if rank == 1 and name == "own_lost":
            shutil.rmtree(store.own_dir(base, 1))
        if rank == 1 and name == "both_lost":
            shutil.rmtree(store.own_dir(base, 1))
            shutil.rmtree(store.held_dir(base, peer_of(1, WORLD, WORLD), 1))
        if rank == 1 and name == "damaged":
            damaged = store.copy_dir(base, 1, CRASH - 1) / "rank_00001.pt"
            data = bytearray(damaged.read_bytes())
            data[len(data) // 2] ^= 0xFF
            damaged.write_bytes(bytes(data))
        dist.barrier()
        runs[name], runs[f"{name}_log"] = _resume(argv, _alone(rank) if name == "own_lost"
                                                  else None)
        runs[f"{name}_left"] = sorted(p.name for p in base.iterdir())
    return runs


def _check(per_rank: list[dict], scenarios: tuple[str, ...]) -> None:
    continuous = merge_ranks([r["continuous"] for r in per_rank])
    assert all(r["ended_clean"] for r in per_rank)
    for name in scenarios:
        resumed = merge_ranks([r[name] for r in per_rank])
        start = 2 if name == "both_lost" else CRASH - 1  # global at 2, local at 3
        assert resumed.losses == continuous.losses[start:], name  # bitwise
        assert resumed.grad_norms == continuous.grad_norms[start:], name
        for key, value in continuous.params.items():
            assert torch.equal(resumed.params[key], value), (name, key)
        log = per_rank[0][f"{name}_log"]
        notices = [line for line in log if line.startswith("notice:")]
        if name == "both_lost":
            assert len(notices) == 1 and "iteration 3 lost rank(s) 1's" in notices[0], log
            assert "global checkpoint at iteration 2" in notices[0], log
        else:
            assert not notices, log
            assert f"resuming from the local checkpoint at iteration {CRASH - 1}" in log[-1]
        if name == "own_lost":
            assert "rank 1's state from the replica" in log[-1] and "sent by rank 2" in log[-1]
        if name == "damaged":
            assert "rank 1's state from the replica" in log[-1], log
        assert all(r[f"{name}_left"] == [] for r in per_rank), name  # removed at the end


@pytest.mark.parametrize(("layout", "scenarios"), [
    (ZERO1_PP2_DP2, ("own", "own_lost", "both_lost")),
    (ZERO3_TP2_DP2, ("own", "damaged"))], ids=["pp2-dp2-zero1", "tp2-dp2-zero3"])
def test_a_failed_run_resumes_bitwise_from_the_newest_local_state(tmp_path, layout, scenarios):
    per_rank = run_distributed(_scenarios, WORLD, str(tmp_path), layout, scenarios,
                               timeout_s=300)
    _check(per_rank, scenarios)
