"""The memory model against what real CPU runs allocate: the peak of the tensor storage bytes
a whole run creates (build, two training steps, an evaluation), counted by ``PeakMemory``,
equals the model's peak on the CPU (no CUDA context, NCCL or allocator reserve there) within
5%, in one process for every flavour, precision and recompute, and on every rank of a
pipeline, of ZeRO-1 with bf16 gradient reduction, of ZeRO-3 and of TP with sequence
parallelism.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from megatron3d.accounting.activations import PeakMemory
from megatron3d.accounting.fit import layout_memory
from megatron3d.cli.arguments import parse_args
from tests.helpers.dist import run_distributed
from tests.helpers.runs import train, train_single
from tests.helpers.tiny import FLAVOUR_FLAGS

MODEL_RTOL = 0.05


def _argv(flavour: str, *extra: str) -> list[str]:
    """Big enough that the terms the model counts dominate the few small tensors it does not
    (step counters, losses, norms)."""
    return ["--num-layers", "3", "--hidden-size", "128", "--num-attention-heads", "4",
            "--seq-length", "128", "--micro-batch-size", "4", "--global-batch-size", "8",
            "--train-iters", "2", "--lr", "1e-3", "--mock-data", "--vocab-size", "2000",
            "--make-vocab-size-divisible-by", "8", "--attention-dropout", "0",
            "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "1",
            *FLAVOUR_FLAGS[flavour], *extra]


def _predicted(argv: list[str], world_size: int, pp_rank: int) -> int:
    return layout_memory(parse_args(argv), world_size, "cpu")[pp_rank].total


@pytest.mark.parametrize("extra", [(), ("--bf16",), ("--bf16", "--recompute-granularity", "full"),
                                   ("--bf16", "--recompute-granularity", "selective")],
                         ids=["fp32", "bf16", "bf16-full", "bf16-selective"])
@pytest.mark.parametrize("flavour", ["gpt2", "llama"])
def test_one_process_peak_is_the_models(flavour, extra):
    argv = _argv(flavour, *extra)
    with PeakMemory() as peak:
        train_single(argv)
    predicted = _predicted(argv, 1, 0)
    assert abs(predicted - peak.peak) <= MODEL_RTOL * peak.peak, (predicted, peak.peak)


def _measure_rank(argv: list[str]) -> tuple[int, int]:
    with PeakMemory() as peak:
        train(argv)
    world = dist.get_world_size()
    pp = parse_args(argv).parallel.pipeline_model_parallel_size
    return peak.peak, _predicted(argv, world, dist.get_rank() // (world // pp))


@pytest.mark.parametrize("extra", [
    ("--pipeline-model-parallel-size", "2", "--bf16", "--recompute-granularity", "full"),
    ("--zero-stage", "1", "--bf16", "--grad-reduce-in-bf16"),
    ("--zero-stage", "3", "--bf16"),
    ("--tensor-model-parallel-size", "2", "--sequence-parallel", "--bf16"),
], ids=["pp2-full", "zero1-dp2-bf16-wire", "zero3-dp2", "tp2-sp"])
def test_every_rank_of_a_parallel_run_peaks_where_the_model_says(extra):
    for measured, predicted in run_distributed(_measure_rank, 2, _argv("gpt2", *extra)):
        assert abs(predicted - measured) <= MODEL_RTOL * measured, (predicted, measured)
