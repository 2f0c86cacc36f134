"""Whether a layout fits in device memory: the peak of every pipeline rank (``peak.py``)
against the device's memory less ``--memory-headroom``.

``pretrain_gpt.py`` calls ``check_fits`` before any process group starts, and the topology
planner judges every candidate with ``layout_memory`` and ``usable_bytes``: a layout the
planner calls feasible passes the start-up check, and one it refuses is refused at start
with the same numbers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from megatron3d.accounting.memory import Buffers, planned_buffers
from megatron3d.accounting.nodes import node_buffers, replica_nodes
from megatron3d.accounting.peak import RankMemory, rank_memory
from megatron3d.accounting.placement import Placement, placement
from megatron3d.config import TrainConfig
from megatron3d.errors import ConfigError
from megatron3d.mpu.state import ranks_per_node
from megatron3d.optim.batch_schedule import BatchSchedule

GIB = 2**30
BuffersOf = Callable[[TrainConfig, int, Placement, int], Buffers]
"""(the layout's config, its replicas of the weights (DP x CP), its placement, a pipeline
rank) -> the rank's ZeRO buffers."""


def rank_buffers(cfg: TrainConfig, replicas: int, where: Placement, rank: int) -> Buffers:
    """``planned_buffers`` of pipeline rank ``rank``: its chunks built on the meta device,
    ZeRO sharding over the ``replicas`` (context-parallel ranks hold the same weights), or
    over the node's replicas with the node-aware ZeRO-3 (``nodes.node_buffers``)."""
    parallel = cfg.parallel

    def flat(plain: TrainConfig, shards: int) -> Buffers:
        return planned_buffers(plain, parallel.tensor_model_parallel_size, shards,
                               list(where.spans[rank]))

    if not parallel.node_aware_zero3:
        return flat(cfg, replicas)
    world = (parallel.tensor_model_parallel_size * parallel.pipeline_model_parallel_size
             * replicas)
    nodes = replica_nodes(parallel, replicas, ranks_per_node(parallel.gpus_per_node, world))
    return node_buffers(cfg, replicas, nodes, flat)


def layout_memory(cfg: TrainConfig, world_size: int, device_type: str = "cuda",
                  buffers_of: BuffersOf = rank_buffers) -> list[RankMemory]:
    """Every pipeline rank of ``cfg``'s layout on ``world_size`` ranks, at the largest global
    batch of its rampup (``cfg`` must have passed validation). With real data the vocabulary
    is not known before the tokenizer is read and counts as one token (the logits then count
    nothing). ``buffers_of`` gives a rank's ZeRO buffers (the planner caches them)."""
    if not cfg.model.vocab_size:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=1))
    parallel = cfg.parallel
    dp = parallel.data_parallel_size(world_size)
    where = placement(cfg)
    schedule = BatchSchedule.from_config(cfg.training, dp)
    micro_batches = schedule.global_batch_size // schedule.samples_per_micro_batch_step
    padded_vocab = cfg.model.padded_vocab_size(parallel.tensor_model_parallel_size)
    replicas = dp * parallel.context_parallel_size
    return [rank_memory(cfg, buffers_of(cfg, replicas, where, r), dp, r, micro_batches,
                        where.chunk_names(r), padded_vocab, device_type)
            for r in range(parallel.pipeline_model_parallel_size)]


def format_phases(rank: RankMemory, pp_rank: int, cp: int = 1, cp_comm_type: str = "") -> str:
    """The start-up line of a rank's predicted peak per phase (``peak.py``), in GiB; under
    context parallelism (``cp`` > 1) it says so, and which exchange the prediction is for."""
    phases = " | ".join(f"{p.phase} {p.total / GIB:.3f}" + ("" if p.phase in rank.runs
                                                             else " (not run)")
                        for p in rank.phases)
    split = (f", context-parallel {cp} ({cp_comm_type}): 1/{cp} of each sequence"
             if cp > 1 else "")
    return (f"memory predicted for pipeline rank {pp_rank}{split} (GiB, tensors + allocator, "
            f"CUDA and NCCL): {phases} | peak {rank.peak.phase}")


def usable_bytes(capacity: int, headroom: float) -> int:
    """What a layout may use of ``capacity`` bytes: all but the ``headroom`` share."""
    return int(capacity * (1 - headroom))


def fullest(ranks: list[RankMemory]) -> int:
    """The pipeline rank with the highest peak."""
    return max(range(len(ranks)), key=lambda r: ranks[r].total)


def shortfall(ranks: list[RankMemory], capacity: int, headroom: float) -> str:
    """Why the layout does not fit (one line), or "" when its fullest rank does."""
    r = fullest(ranks)
    peak, usable = ranks[r].peak, usable_bytes(capacity, headroom)
    if peak.total <= usable:
        return ""
    parts = ", ".join(f"{name} {size / GIB:.1f}" for name, size in peak.parts)
    device = peak.reserve + peak.context + peak.nccl
    return (f"out of memory: pipeline rank {r} needs {peak.total / GIB:.1f} GiB ({peak.phase}) "
            f"of {usable / GIB:.1f} GiB usable ({capacity / GIB:.1f} GiB less "
            f"{headroom:.0%} headroom) -- {parts}, allocator, CUDA and NCCL {device / GIB:.1f}")


def check_fits(cfg: TrainConfig, world_size: int, capacity: int,
               device_type: str = "cuda") -> None:
    """``ConfigError`` before any work when a rank's predicted peak (build, training step,
    evaluation or save) exceeds its ``capacity`` bytes less ``--memory-headroom``, instead of
    an out-of-memory error hours later."""
    headroom = cfg.parallel.memory_headroom
    reason = shortfall(layout_memory(cfg, world_size, device_type), capacity, headroom)
    if reason:
        raise ConfigError(
            f"the layout does not fit: {reason}; raise --tensor-model-parallel-size or "
            "--pipeline-model-parallel-size, use --zero-stage 1 or 3, full recompute, a "
            "smaller --micro-batch-size (tools/plan_topology.py ranks the layouts that fit), "
            "or lower --memory-headroom if you know the run fits")
