"""--rerun-on-bad-step on 4 and 2 ranks: a transient fault (a NaN in one rank's local
gradients, a spike in one rank's loss) is re-run, its rank named and nobody else, and the run
goes on bitwise as a clean one; the same rank at fault --rerun-max-faults-per-rank times stops
the run (exit 1, its checkpoint kept); a sample that always gives NaN is skipped, its sample
ids logged and kept in the checkpoint, and a run resumed from before it reproduces bitwise;
without faults the flag changes nothing."""

from __future__ import annotations

import dataclasses
import json
import logging
import socket

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron3d.checkpoint import io
from megatron3d.checkpoint.reader import find
from megatron3d.data.mock import MockGPTDataset
from megatron3d.errors import TrainingError
from megatron3d.training.build import Overrides
from tests.helpers.bad_steps import NaNBeforeReduce, PoisonedSample, SpikeOnce
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
    seen: dict = {"losses": [], "skipped": [], "error": None}

    def on_step(_: int, result) -> None:
        seen["losses"].append(result.loss.item())
        seen["skipped"].append(result.stats.skipped.item())

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


# A sample of iteration 5 (samples 32-39), read by DP rank 0. Not iteration 4: a run resumed
# at 2 whose second step is skipped at a save is refused by divergence.SkipWatch as one whose
# every step after its first failed (--lr 1e30), with or without the flag.
POISON = 35
BAD_DATA = ("--rerun-on-bad-step", "--save-interval", "2")


def _bad_sample(first: str, second: str) -> dict[str, dict]:
    tokens = MockGPTDataset(203, 16, 1234).samples(POISON, 1)[0, :-1]
    argv = train_argv("gpt2", 6, *BAD_DATA)
    runs = {}
    for name, flags in (("whole", ("--save", first)),
                        ("until 2", ("--save", second, "--exit-interval", "2")),
                        ("resumed", ("--save", second, "--load", second))):
        poisoned: list[PoisonedSample] = []

        def poison(engine, poisoned=poisoned) -> PoisonedSample:
            poisoned.append(PoisonedSample(engine, tokens))
            return poisoned[0]

        runs[name] = _run([*argv, *flags], Overrides(engine=poison))
        runs[name]["hits"] = poisoned[0].hits
    return runs


def test_a_sample_that_always_gives_nan_is_skipped_recorded_and_resumes_bitwise(tmp_path):
    first, second = tmp_path / "whole", tmp_path / "resumed"
    per_rank = run_distributed(_bad_sample, 2, str(first), str(second), timeout_s=180)
    record = [{"iteration": 5, "first_sample": 32, "samples": 8}]
    for rank, runs in enumerate(per_rank):
        whole, resumed = runs["whole"], runs["resumed"]
        assert whole["skipped"] == [0.0, 0.0, 0.0, 0.0, 1.0, 0.0], rank
        assert whole["hits"] == (2 if rank == 0 else 0), rank  # the step and its re-run
        assert whole["progress"]["consumed_samples"] == 48, rank  # the data moved past it
        assert whole["progress"]["skipped_batches"] == record, rank
        assert _bits(resumed["losses"]) == _bits(whole["losses"][2:]), rank
        assert resumed["progress"] == whole["progress"], rank
        for mine, theirs in zip(resumed["params"], whole["params"], strict=True):
            assert torch.equal(mine, theirs), rank
        assert _fault_lines(whole) == [], rank
    data_line = ("rerun: iteration 5 gave the same result on its re-run (loss not finite, grad "
                 "norm not finite): bad data; "
                 "the batch is skipped (training samples 32-39, recorded in the checkpoint)")
    assert per_rank[1]["whole"]["lines"].count(data_line) == 1
    assert data_line not in per_rank[0]["whole"]["lines"]  # said once, by the logging rank
    for directory in (first, second):
        meta = json.loads((find(str(directory)) / "meta.json").read_text())
        assert meta["skipped_batches"] == record and meta["iteration"] == 6
    assert io.read_meta(find(str(second)))["recent_losses"] == per_rank[1]["whole"][
        "progress"]["recent_losses"]
