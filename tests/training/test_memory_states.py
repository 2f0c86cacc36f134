"""The memory model's parameter, gradient and optimizer-state parts equal what every rank of a
CPU run really holds, to the byte: ZeRO-0/1/3, TP, PP, interleaving, bf16/fp16/fp32, bf16
gradient reduction, sequence parallelism and grouped-query attention. The model builds each
rank's stage and ZeRO buffers on the meta device (``training.memory.planned_buffers``); the
runs read their real buffers after one step (Adam's moments exist then)."""

from __future__ import annotations

import torch

from megatron3d.accounting import memory
from tests.helpers.dist import run_distributed
from tests.helpers.runs import build
from tests.helpers.tiny import train_argv

# (flavour, flags) of 4-rank runs; every layout is one run of one step (an fp16 step that
# overflowed would be skipped and leave no Adam state: its loss scale starts low).
LAYOUTS = [
    ("bloom", ("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
               "--fp16", "--initial-loss-scale", "1024")),
    ("bloom", ("--pipeline-model-parallel-size", "2", "--zero-stage", "1", "--bf16",
               "--reduce-bucket-size", "3000")),
    ("llama", ("--tensor-model-parallel-size", "2", "--zero-stage", "3", "--bf16",
               "--grad-reduce-in-bf16", "--zero3-prefetch-depth", "2",
               "--zero3-reshard-after-forward", "false")),
    ("gpt2", ("--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size",
              "2", "--zero-stage", "3")),
    ("gpt2", ("--zero-stage", "1", "--bf16", "--grad-reduce-in-bf16",
              "--reduce-bucket-size", "2000")),
    ("llama", ("--tensor-model-parallel-size", "2", "--sequence-parallel", "--zero-stage", "1",
               "--group-query-attention", "--num-query-groups", "2", "--bf16")),
]


def _measure_and_model() -> list[tuple[memory.MemoryBytes, memory.MemoryBytes]]:
    """(measured, modelled) bytes of this rank for every layout."""
    pairs = []
    for flavour, flags in LAYOUTS:
        trainer, state = build(train_argv(flavour, 1, "--lr-warmup-iters", "0", *flags))
        trainer.run()
        cfg, parallel = trainer.cfg, trainer.cfg.parallel
        spans = [(chunk.first_index, chunk.first_index + len(chunk.layers))
                 for chunk in trainer.model.engine.chunks]
        buffers = memory.planned_buffers(cfg, state.tp.size, state.dp.size, spans)
        param_bytes = getattr(torch, cfg.precision.params_dtype_name).itemsize
        modelled = memory.state_bytes(buffers, param_bytes, parallel.zero_stage, state.dp.size,
                                      2 if parallel.grad_reduce_in_bf16 else 4)
        pairs.append((memory.measured(trainer.model.optimizer, trainer.model.data_parallel),
                      modelled))
    return pairs


def test_states_equal_every_ranks_real_buffers_exactly():
    for rank, pairs in enumerate(run_distributed(_measure_and_model, 4)):
        for (measured, modelled), layout in zip(pairs, LAYOUTS, strict=True):
            assert measured == modelled, (rank, layout)


def test_analytic_totals_are_the_same_formula_without_padding():
    """The start-up report's ``analytic`` is ``state_bytes`` of unpadded totals."""
    for zero, dp in ((0, 1), (1, 4), (3, 4)):
        shard = 1000 // dp if zero else 1000
        assert memory.analytic(1000, 2, zero, dp, 96) == memory.state_bytes(
            memory.Buffers(1000, shard, shard, 96), 2, zero, dp)
