"""Context-parallel checkpoints: a CP 2 run killed with SIGKILL resumes bitwise (weights, Adam
moments and each rank's dropout streams), and a CP 2 checkpoint continues at CP 1 and CP 4
as the uninterrupted single-process run does (ZeRO-1's shards re-cut over dp x cp)."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from tests.helpers.dist import run_distributed
from tests.helpers.launch import launch
from tests.helpers.preemption import ITER_LINE, iter_dir, latest
from tests.helpers.runs import assert_same_run, merge_ranks, reference_run, train, train_single
from tests.helpers.tiny import train_argv
from tests.helpers.tolerances import EQUIVALENCE_FLAGS, FP32

GQA = ("--group-query-attention", "--num-query-groups", "2", "--zero-stage", "1")


def _cp(size: int) -> tuple[str, ...]:
    return ("--context-parallel-size", str(size), "--cp-comm-type", "all_gather")


def _argv(*extra: str) -> list[str]:
    return train_argv("llama", 4, *EQUIVALENCE_FLAGS, *GQA, *extra)


def test_a_cp2_checkpoint_continues_at_cp1_and_cp4(tmp_path):
    saved = str(tmp_path / "cp2")
    run_distributed(train, 2, _argv(*_cp(2), "--save", saved, "--exit-interval", "2"),
                    timeout_s=120)
    assert latest(Path(saved)) == 2
    reference = reference_run(tuple(_argv()))
    cp1 = train_single(_argv("--load", saved))
    cp4 = merge_ranks(run_distributed(train, 4, _argv(*_cp(4), "--load", saved),
                                      timeout_s=120))
    expected = type(reference)(reference.losses[2:], reference.grad_norms[2:],
                               reference.params, reference.eval_loss)
    for name, run in (("CP 1", cp1), ("CP 4", cp4)):
        try:
            assert_same_run(run, expected, FP32)
        except AssertionError as err:
            raise AssertionError(f"{name}: {err}") from err


# SIGKILL mid-run: a model large enough (tens of ms a step) that the kill lands mid-run.
KILLED = ("--hidden-size", "128", "--seq-length", "64", "--hidden-dropout", "0.1",
          "--attention-dropout", "0.1", "--lr-warmup-iters", "1", "--zero-stage", "1", *_cp(2))


def _kill_argv(*extra: str) -> list[str]:
    return train_argv("gpt2", 8, *KILLED, "--save-interval", "2", *extra)


def _continuous_and_resumed(cont: str, killed: str, resumed: str) -> tuple:
    """One rank: the uninterrupted run and the resumption of the killed one."""
    return (train(_kill_argv("--save", cont)),
            train(_kill_argv("--load", killed, "--save", resumed)))


def _rank_file(directory: Path, rank: int) -> dict:
    return torch.load(directory / f"rank_{rank:05d}.pt", map_location="cpu", weights_only=False)


def _assert_same_rank_files(a: Path, b: Path, world: int) -> None:
    """Bitwise equal chunks (ZeRO-1: each rank's half of the weights and moments) and torch
    RNG streams in every rank's file."""
    for rank in range(world):
        pa, pb = _rank_file(a, rank), _rank_file(b, rank)
        ca = {(c["name"], c["kind"], c["start"]): c["data"] for c in pa["chunks"]}
        cb = {(c["name"], c["kind"], c["start"]): c["data"] for c in pb["chunks"]}
        assert ca and ca.keys() == cb.keys(), rank
        assert all(torch.equal(ca[k], cb[k]) for k in ca), f"rank {rank}: chunks differ"
        ra, rb = pa["rng"]["torch"], pb["rng"]["torch"]
        assert ra.keys() == rb.keys() and all(torch.equal(ra[k], rb[k]) for k in ra), rank


def _printed_iterations(log: Path) -> list[int]:
    return [int(m[1]) for m in map(ITER_LINE.match, log.read_text().splitlines()) if m]


def test_sigkill_at_cp2_then_resume_is_bitwise(tmp_path):
    killed = tmp_path / "killed"
    job = launch("pretrain_gpt.py", _kill_argv("--save", str(killed)), 2, tmp_path)
    try:  # the logging rank (the last) prints the iteration lines
        deadline = time.monotonic() + 90
        while not any(i >= 4 for i in _printed_iterations(job.logs[1])):
            assert all(p.poll() is None for p in job.procs), job.output(1)[-3000:]
            assert time.monotonic() < deadline, job.output(1)[-3000:]
            time.sleep(0.05)
    finally:
        job.kill()  # SIGKILL to every rank
    stopped = latest(killed)
    assert stopped is not None and 2 <= stopped < 8, stopped
    cont, resumed = tmp_path / "cont", tmp_path / "resumed"
    per_rank = run_distributed(_continuous_and_resumed, 2, str(cont), str(killed),
                               str(resumed), timeout_s=180)
    continuous, again = (merge_ranks([r[i] for r in per_rank]) for i in (0, 1))
    assert again.losses == continuous.losses[stopped:]
    assert again.grad_norms == continuous.grad_norms[stopped:]
    _assert_same_rank_files(iter_dir(resumed, 8), iter_dir(cont, 8), 2)
