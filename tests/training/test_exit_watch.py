"""The exit watch agrees across ranks: a signal that reaches one rank only stops every rank
after the same iteration (the next step's, as the agreement is read a step late), with the
same reason, a checkpoint there, and no end-of-run evaluation."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch

from tests.helpers.dist import run_distributed
from tests.helpers.preemption import latest
from tests.helpers.runs import build
from tests.helpers.tiny import train_argv


def _signal_on_one_rank(directory: str, *layout: str) -> dict:
    """SIGUSR1 to the last rank alone, during iteration 2's hooks."""
    last = torch.distributed.get_world_size() - 1
    hit = torch.distributed.get_rank() == last

    def on_step(iteration: int, _result) -> None:
        if hit and iteration == 2:
            os.kill(os.getpid(), signal.SIGUSR1)

    trainer, _ = build(train_argv("gpt2", 50, "--save", directory, *layout), on_step=on_step)
    trainer.run()
    return {"iteration": trainer.progress.iteration, "pressed": trainer.exit_watch.pressed,
            "latest": latest(Path(directory))}


def test_a_signal_on_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    """Mutation: agreeing on nothing (each rank reading its own flags) leaves rank 0 training
    while the others save, and the job hangs (the test times out)."""
    for layout in (("--zero-stage", "1"), ("--pipeline-model-parallel-size", "2")):
        directory = tmp_path / layout[0].strip("-")
        per_rank = run_distributed(_signal_on_one_rank, 2, str(directory), *layout,
                                   timeout_s=90)
        assert per_rank == [{"iteration": 3, "pressed": True, "latest": 3}] * 2, layout
