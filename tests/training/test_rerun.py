"""--rerun-on-bad-step on 4 and 2 ranks: a transient fault (a NaN in one rank's local
gradients, a spike in one rank's loss) is re-run, its rank named and nobody else, and the run
goes on bitwise as a clean one; the same rank at fault --rerun-max-faults-per-rank times stops
the run (exit 1, its checkpoint kept); a sample that always gives NaN and one that always gives
a loss spike are skipped, their sample ids logged and kept in the checkpoint, and a run resumed
between them skips the second alike; without faults the flag changes nothing."""

from __future__ import annotations

import dataclasses
import logging
import socket

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron3d.checkpoint import io
from megatron3d.checkpoint.reader import find
from megatron3d.data.mock import MockGPTDataset
from megatron3d.errors import TrainingError
from megatron3d.training.build import Overrides
from tests.helpers.bad_steps import NaNBeforeReduce, PoisonedSample, SpikeOnce, SpikySample
from tests.helpers.dist import run_distributed
from tests.helpers.log_lines import LogLines
from tests.helpers.runs import build
from tests.helpers.tiny import train_argv

ITERS = 5
LAYOUT = ("--pipeline-model-parallel-size", "2", "--zero-stage", "1")
RERUN = ("--rerun-on-bad-step", "--rerun-spike-window", "2")
BAD_RANK, SPIKE_RANK = 1, 3  # first stage, DP rank 1; last stage (holds the loss), DP rank 1


def _run(argv: list[str], overrides: Overrides | None = None) -> dict:
    """Train; what each step reported, the final parameters, the rerun lines, or the error."""
    lines = LogLines()
    rerun_log = logging.getLogger("megatron3d.training.rerun")
    rerun_log.addHandler(lines)
    rerun_log.setLevel(logging.INFO)
    seen: dict = {"losses": [], "skipped": [], "error": None, "after": {}}

    def on_step(iteration: int, result) -> None:
        seen["losses"].append(result.loss.item())
        seen["skipped"].append(result.stats.skipped.item())
        seen["after"][iteration] = [p.detach().clone()
                                    for p in trainer.model.engine.stage.parameters()]

    trainer, state = build(argv, overrides, on_step=on_step)
    try:
        trainer.run()
    except TrainingError as err:
        seen["error"] = str(err)
    finally:
        rerun_log.removeHandler(lines)
    seen["params"] = [p.detach().clone() for p in trainer.model.engine.stage.parameters()]
    seen["lines"], seen["rank"] = lines.lines, state.world_rank
    seen["progress"] = dataclasses.asdict(trainer.progress)
    return seen


def _transient_faults(board: str, save: str) -> dict[str, dict]:
    rank = torch.distributed.get_rank()
    # dropout on: a re-run that did not start from the step's RNG states would differ
    argv = train_argv("gpt2", ITERS, *LAYOUT, "--hidden-dropout", "0.1")

    def nan_at(passes: set[int]) -> Overrides:
        return Overrides(grad_sync=lambda sync: NaNBeforeReduce(sync, passes, rank == BAD_RANK))

    spike = Overrides(engine=lambda engine: SpikeOnce(engine, 4, rank == SPIKE_RANK, 100.0))
    return {
        "plain": _run(argv),
        "clean": _run([*argv, *RERUN]),
        "nan": _run([*argv, *RERUN, "--tensorboard-dir", board], nan_at({3})),
        "spike": _run([*argv, *RERUN], spike),
        # passes: iteration 2 is passes 2 and 3, iteration 4 is pass 5: two faults on rank 1
        "limit": _run([*argv, *RERUN, "--rerun-max-faults-per-rank", "2", "--save", save,
                       "--save-interval", "2"], nan_at({2, 5})),
    }


def _bits(losses: list[float]) -> list[str]:
    """Losses as exact text: NaN equals NaN, any other difference shows."""
    return [float.hex(x) for x in losses]


def _assert_same(run: dict, clean: dict, what: str) -> None:
    assert _bits(run["losses"]) == _bits(clean["losses"]), what
    for mine, theirs in zip(run["params"], clean["params"], strict=True):
        assert torch.equal(mine, theirs), what


def _fault_lines(run: dict) -> list[str]:
    """The warnings naming a rank (each from the rank named)."""
    return [line for line in run["lines"] if line.startswith("rank ")]


def test_a_transient_fault_is_rerun_named_and_the_run_continues_bitwise(tmp_path):
    board, save = tmp_path / "board", tmp_path / "save"
    per_rank = run_distributed(_transient_faults, 4, str(board), str(save), timeout_s=180)
    host = socket.gethostname()
    for rank, runs in enumerate(per_rank):
        clean = runs["clean"]
        _assert_same(runs["plain"], clean, f"rank {rank}: the flag alone changed the run")
        assert clean["lines"] == [] and clean["skipped"] == [0.0] * ITERS, rank
        for case, faulty, at in (("nan", BAD_RANK, 3), ("spike", SPIKE_RANK, 4)):
            run = runs[case]
            _assert_same(run, clean, f"rank {rank}: {case}")
            assert run["skipped"] == [0.0] * ITERS and run["error"] is None, (rank, case)
            expected = [f"rank {faulty} on node {host} computed iteration {at} "
                        "differently on its re-run: a transient fault (1 of "
                        "--rerun-max-faults-per-rank 2); training goes on with the re-run's "
                        "result"] if rank == faulty else []
            assert _fault_lines(run) == expected, (rank, case)
        assert runs["nan"]["progress"]["skipped_batches"] == [], rank
    logging_rank = per_rank[3]
    assert ("rerun: iteration 3 is bad (grad norm not finite): re-running it with the same data "
            "and RNG states") in logging_rank["nan"]["lines"]
    assert ("rerun: iteration 3: a transient fault on rank(s) [1]; training goes on with the "
            "re-run's result") in logging_rank["nan"]["lines"]
    assert any(line.startswith("rerun: iteration 4 is bad (loss spike") for line in
               logging_rank["spike"]["lines"]), logging_rank["spike"]["lines"]
    events = EventAccumulator(str(board))
    events.Reload()
    faults = [(e.step, e.value) for e in events.Scalars("rerun transient faults rank 1")]
    assert faults == [(3, 1.0)]

    stop = (f"rank 1 on node {host} computed iteration 4 differently on its re-run: its 2nd "
            "transient fault, --rerun-max-faults-per-rank 2 reached: training stopped; "
            f"iteration 3 is saved in {save}; exclude node {host} (e.g. sbatch --exclude="
            f"{host}) and resume with --load")
    for rank, runs in enumerate(per_rank):
        limit = runs["limit"]
        assert limit["error"] == stop, rank
        assert len(limit["losses"]) == 3, rank  # iteration 4 was neither applied nor reported
        assert limit["progress"]["iteration"] == 3, rank
    assert (save / "latest").read_text().strip() == "3"


# Samples read at iterations 3 (16-23) and 5 (32-39) by DP ranks 0 and 1: one always gives a
# NaN loss, the other a loss spike. The run resumed at 4 needs both the record of iteration 3
# and the recent losses its spike is judged against from the checkpoint.
NAN_SAMPLE, SPIKY_SAMPLE = 17, 38
BAD_DATA = ("--rerun-on-bad-step", "--rerun-spike-window", "2", "--save-interval", "2")
RECORD = [{"iteration": 3, "first_sample": 16, "samples": 8},
          {"iteration": 5, "first_sample": 32, "samples": 8}]


def _bad_samples(first: str, second: str) -> dict[str, dict]:
    data = MockGPTDataset(203, 16, 1234)
    nan, spiky = (data.samples(i, 1)[0, :-1] for i in (NAN_SAMPLE, SPIKY_SAMPLE))
    argv = train_argv("gpt2", 6, *BAD_DATA)
    runs = {}
    for name, flags in (("whole", ("--save", first)),
                        ("until 4", ("--save", second, "--exit-interval", "4")),
                        ("resumed", ("--save", second, "--load", second))):
        made: list[SpikySample] = []

        def poison(engine, made=made) -> SpikySample:
            made.append(SpikySample(PoisonedSample(engine, nan), spiky, 100.0))
            return made[0]

        runs[name] = _run([*argv, *flags], Overrides(engine=poison))
        runs[name]["hits"] = (made[0].inner.hits, made[0].hits)
    return runs


def test_a_bad_sample_is_skipped_recorded_and_a_resumed_run_skips_it_alike(tmp_path):
    first, second = tmp_path / "whole", tmp_path / "resumed"
    per_rank = run_distributed(_bad_samples, 2, str(first), str(second), timeout_s=180)
    for rank, runs in enumerate(per_rank):
        whole, resumed = runs["whole"], runs["resumed"]
        assert whole["skipped"] == [0.0, 0.0, 1.0, 0.0, 1.0, 0.0], rank
        assert whole["hits"] == ((2, 0) if rank == 0 else (0, 2)), rank  # a step, its re-run
        after = whole["after"]
        for skipped in (3, 5):  # nothing applied: the spike's finite gradients neither
            for mine, theirs in zip(after[skipped], after[skipped - 1], strict=True):
                assert torch.equal(mine, theirs), (rank, skipped)
        assert whole["progress"]["consumed_samples"] == 48, rank  # the data moved past them
        assert whole["progress"]["skipped_batches"] == RECORD, rank
        assert _bits(resumed["losses"]) == _bits(whole["losses"][4:]), rank
        assert resumed["progress"] == whole["progress"], rank
        for mine, theirs in zip(resumed["params"], whole["params"], strict=True):
            assert torch.equal(mine, theirs), rank
        assert _fault_lines(whole) == [], rank
    lines = per_rank[1]["whole"]["lines"]
    for line in ("rerun: iteration 3 gave the same result on its re-run (loss not finite, grad "
                 "norm not finite): bad data; the batch is skipped (training samples 16-23, "
                 "recorded in the checkpoint)",
                 "rerun: iteration 5 gave the same result on its re-run (loss spike: "):
        assert sum(x.startswith(line) for x in lines) == 1, lines
        assert not any(x.startswith(line) for x in per_rank[0]["whole"]["lines"])
    assert "(training samples 32-39, recorded in the checkpoint)" in lines[-1]
    for directory in (first, second):
        meta = io.read_meta(find(str(directory)))
        assert meta["skipped_batches"] == RECORD and meta["iteration"] == 6
        assert meta["recent_losses"] == per_rank[1]["whole"]["progress"]["recent_losses"]


def test_the_flag_costs_one_host_read_per_step(monkeypatch):
    """Its documented cost: with no log line, evaluation or save in between, each step after
    the first moves one tensor to the host (the agreed verdict), no more."""
    from megatron3d import device as devices
    from tests.helpers.host_sync import SYNCS

    reads: list[str] = []
    for name in SYNCS:
        real = getattr(torch.Tensor, name)

        def counted(self, *args, real=real, name=name, **kwargs):
            reads.append(name)
            return real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    per_step: list[int] = []
    devices.init_process_group(devices.LaunchEnv(0, 1, 0, launched=False))
    try:
        trainer, _ = build(train_argv("gpt2", 4, "--rerun-on-bad-step", "--log-interval", "100"),
                           on_step=lambda *_: per_step.append(len(reads)))
        trainer.run()
    finally:
        torch.distributed.destroy_process_group()
    assert [b - a for a, b in zip(per_step[:-1], per_step[1:], strict=True)] == [1, 1, 1], reads
