"""A save copies the optimizer state to host memory without a copy on the device (issue 28):
each rank's peak memory during a save grows by at most its host snapshot (12 bytes per
element it writes, pinned host memory on GPUs) plus 64 MiB, at ZeRO 0, 1 and 3. Before, every
rank first gathered its whole shard's state into new device tensors (12 bytes per shard
element, on every DP replica without ZeRO although only one writes), then cloned the chunks.

On the CPU device and host memory are one: the test reads each rank's peak RSS (``VmHWM``,
reset through ``/proc/self/clear_refs`` just before the save) and allows the host snapshot,
which on a GPU lives in host memory, so what is left is what a GPU's memory would see.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from megatron3d import device as devices
from megatron3d.checkpoint.chunks import owned_parts
from megatron3d.checkpoint.progress import Progress
from megatron3d.training.build import Overrides
from tests.helpers.dist import run_distributed
from tests.helpers.runs import build
from tests.training.test_init_memory import _can_reset_peak

CPU = torch.device("cpu")
MIB = 2**20
DEVICE_BOUND = 64 * MIB  # the bound on what a save may add beyond its host copy
# 4 layers of hidden 640, a small vocabulary: 20M parameters, 245 MB of fp32 weights and Adam
# moments, so a second copy of a rank's state (>= 120 MB at DP=2) shows far above the bound.
MODEL = ["--num-layers", "4", "--hidden-size", "640", "--num-attention-heads", "10",
         "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "2",
         "--train-iters", "1", "--lr", "1e-4", "--mock-data", "--vocab-size", "1024",
         "--eval-iters", "0", "--log-interval", "1"]


class _Measured:
    """The trainer's saver, with each save's peak RSS growth recorded."""

    def __init__(self, saver: Any) -> None:
        self.saver, self.growth = saver, []

    def __call__(self, progress: Progress) -> str:
        start = devices.reset_peak_memory(CPU)  # VmHWM := VmRSS
        directory = self.saver(progress)
        self.growth.append(devices.peak_memory(CPU) - start)
        return directory

    def wait(self) -> None:
        self.saver.wait()


def _save_growth(directory: str, zero: int) -> dict:
    measured: list[_Measured] = []

    def measure(saver: Any) -> _Measured:
        measured.append(_Measured(saver))
        return measured[0]

    trainer, state = build([*MODEL, "--zero-stage", str(zero), "--save", directory],
                           Overrides(save=measure))
    trainer.run()
    params = list(trainer.model.engine.stage.parameters())
    owned = sum(end - start for _, start, end, _ in owned_parts(
        params, trainer.model.optimizer.shard, state, trainer.model.optimizer.replica_axes))
    return {"growth": measured[0].growth, "host": 12 * owned,
            "shard": trainer.model.optimizer.shard.numel}


@pytest.mark.skipif(not _can_reset_peak(), reason="needs Linux's /proc/self/clear_refs")
@pytest.mark.parametrize("zero", [0, 1, 3])
def test_a_save_adds_only_its_host_snapshot(tmp_path, zero):
    for rank, r in enumerate(run_distributed(_save_growth, 2, str(tmp_path / "ckpt"), zero,
                                             timeout_s=240)):
        assert r["shard"] * 12 > 1.5 * DEVICE_BOUND  # a device copy of it would show
        [growth] = r["growth"]  # the one save, at the end of the run
        assert growth <= r["host"] + DEVICE_BOUND, (
            f"rank {rank}: a save grew {growth / MIB:.0f} MiB with a host snapshot of "
            f"{r['host'] / MIB:.0f} MiB")
