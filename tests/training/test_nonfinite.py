"""When a run diverges: a NaN in one rank's gradients skips that step on every rank in bf16
and fp32, decided without a host sync and counted in the log line; with
--check-for-nan-in-loss-and-grad every rank stops with one line instead; a save refuses
non-finite weights and leaves the earlier checkpoints as they were."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import re
from pathlib import Path

import pytest
import torch

from megatron3d.checkpoint.progress import Progress
from megatron3d.errors import TrainingError
from megatron3d.training.build import Overrides
from megatron3d.training.grad_sync import GradSync
from tests.helpers.dist import run_distributed
from tests.helpers.faults import CorruptAfterReduce
from tests.helpers.host_sync import no_host_sync
from tests.helpers.log_lines import LogLines
from tests.helpers.runs import build
from tests.helpers.tiny import train_argv

BAD_STEP, ITERS = 3, 4
# (precision, layout, poisoned rank): the NaN appears after the gradient reduction, on a rank
# that only some of the others share gradients with, so the decision must be agreed: over the
# pipeline and a DP replica (ZeRO-0, bf16 master weights), or over TP and the ZeRO-1 shards
# (fp32, the parameters are the master weights).
CASES = {
    "bf16-pp2-dp2": (("--bf16",), ("--pipeline-model-parallel-size", "2"), 1),
    "fp32-tp2-dp2-zero1": ((), ("--tensor-model-parallel-size", "2", "--zero-stage", "1"), 3),
}
COUNTS = re.compile(r"number of skipped iterations: +(\d+) \| number of nan iterations: +(\d+)")


def _snapshot(trainer) -> dict[str, torch.Tensor]:
    """Parameters as the model holds them, and the optimizer's fp32 weights, moments, step."""
    params = {f"param{i}": p.detach().clone()
              for i, p in enumerate(trainer.model.engine.stage.parameters())}
    return {**params, **trainer.model.optimizer.local_state()}


def _poisoned_run(precision: tuple[str, ...], layout: tuple[str, ...], bad_rank: int,
                  *flags: str) -> dict:
    def corrupted(sync: GradSync) -> CorruptAfterReduce:
        shard = sync.data_parallel.shard
        return CorruptAfterReduce(sync, lambda: shard.counted_grads()[0], BAD_STEP,
                                  sync.state.world_rank == bad_rank, float("nan"))

    lines = LogLines()
    logging.getLogger("megatron3d.training.reporting").addHandler(lines)
    logging.getLogger("megatron3d.training.reporting").setLevel(logging.INFO)
    checked = "--check-for-nan-in-loss-and-grad" in flags  # which may sync with the host
    seen: dict = {"losses": [], "norms": [], "skipped": [], "nan": []}
    no_sync = contextlib.ExitStack()

    def on_step(iteration: int, result) -> None:
        no_sync.close()
        for key, value in (("losses", result.loss), ("norms", result.stats.grad_norm),
                           ("skipped", result.stats.skipped), ("nan", result.stats.nan)):
            seen[key].append(value.item())
        if iteration in (BAD_STEP - 1, BAD_STEP, ITERS):
            seen[iteration] = _snapshot(trainer)
        if iteration == BAD_STEP - 1 and not checked:  # the bad step runs without host syncs
            no_sync.enter_context(no_host_sync())

    trainer, state = build(train_argv("gpt2", ITERS, *precision, *layout, "--log-interval",
                                      str(ITERS), *flags), Overrides(grad_sync=corrupted),
                           on_step=on_step)
    try:
        with no_sync:
            trainer.run()
    except TrainingError as err:
        seen["error"] = str(err)
        seen["after_error"] = _snapshot(trainer)
    seen["lines"] = [ln for ln in lines.lines if COUNTS.search(ln)]
    seen["last_stage"] = state.is_last_stage
    return seen


@pytest.mark.parametrize(("precision", "layout", "bad_rank"), CASES.values(), ids=CASES)
def test_nan_in_one_ranks_gradients_skips_the_step_everywhere(precision, layout, bad_rank):
    per_rank = run_distributed(_poisoned_run, 4, precision, layout, bad_rank)
    for rank, seen in enumerate(per_rank):
        assert seen["skipped"] == seen["nan"] == [0.0, 0.0, 1.0, 0.0], rank
        assert math.isnan(seen["norms"][BAD_STEP - 1]), rank  # every rank reports it alike
        others = seen["norms"][:BAD_STEP - 1] + seen["norms"][BAD_STEP:]
        assert others == per_rank[0]["norms"][:BAD_STEP - 1] + per_rank[0]["norms"][BAD_STEP:]
        before, after = seen[BAD_STEP - 1], seen[BAD_STEP]
        for name, value in before.items():  # params, fp32 weights, moments, Adam's step
            assert torch.equal(after[name], value), f"rank {rank}: {name} changed"
        assert not torch.equal(seen[ITERS]["weight"], after["weight"]), "training stopped"
        assert seen[ITERS]["step"].item() == ITERS - 1
        if seen["last_stage"]:
            assert all(math.isfinite(loss) for loss in seen["losses"]), seen["losses"]
        assert [COUNTS.search(ln).groups() for ln in seen["lines"]] == [("1", "1")], rank


def test_check_for_nan_stops_every_rank_with_one_line():
    precision, layout, bad_rank = CASES["bf16-pp2-dp2"]
    per_rank = run_distributed(_poisoned_run, 4, precision, layout, bad_rank,
                               "--check-for-nan-in-loss-and-grad")
    for rank, seen in enumerate(per_rank):
        assert seen["error"] == (
            f"global gradient norm is nan at iteration {BAD_STEP}: training stopped by "
            "--check-for-nan-in-loss-and-grad; resume from the last checkpoint with a lower "
            "--lr, or drop the flag to skip such steps"), rank
        assert len(seen["skipped"]) == BAD_STEP - 1  # raised right after the step
        for name, value in seen[BAD_STEP - 1].items():  # and the bad step was not applied
            assert torch.equal(seen["after_error"][name], value), f"rank {rank}: {name}"


def _tree(root: Path) -> dict[str, str]:
    """Every path under ``root`` with its content hash ("dir" for directories)."""
    return {str(p.relative_to(root)): "dir" if p.is_dir()
            else hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*"))}


def _save_poisoned(directory: str, precision: tuple[str, ...]) -> dict:
    """Train 3 steps, saving at 2 and 3; then one rank's fp32 weights go NaN and a save at 4
    is asked (which would also prune iteration 2)."""
    trainer, state = build(train_argv("gpt2", 3, *precision, "--pipeline-model-parallel-size",
                                      "2", "--save", directory, "--save-interval", "2",
                                      "--keep-last-n", "2"))
    trainer.run()
    before = _tree(Path(directory))
    if state.world_rank == 1:
        trainer.model.optimizer.inner.param_groups[0]["params"][0].data.view(-1)[0] = float("nan")
    try:
        trainer.save(Progress(4, 32, 512))
    except TrainingError as err:
        return {"error": str(err), "unchanged": _tree(Path(directory)) == before,
                "files": sorted(before)}
    return {"error": None}


@pytest.mark.parametrize("precision", [(), ("--bf16",)], ids=["fp32", "bf16"])
def test_save_refuses_non_finite_weights_and_keeps_the_checkpoints(tmp_path, precision):
    directory = tmp_path / "ckpt"
    for rank, result in enumerate(run_distributed(_save_poisoned, 2, str(directory),
                                                  precision)):
        assert result["error"] == (
            "the weights at iteration 4 are not finite (NaN/Inf in the fp32 weights or Adam "
            f"moments): nothing was written and the previous checkpoints in {directory} are "
            "kept; resume from the last good one with --load and a lower --lr"), rank
        assert result["unchanged"], rank
        assert {"latest", "iter_0000002/meta.json", "iter_0000003/meta.json"} <= set(
            result["files"])
