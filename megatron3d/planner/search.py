"""Enumerate layouts for a model on a cluster, judge each with the framework's own rules and
the memory and time models, and rank them.

A layout is feasible when ``validation.validate`` accepts it (the very checks
``pretrain_gpt.py`` runs: the rank grid, divisibility, the whole batch rampup, the
interleaved schedule, the partitioner on the real layer list, ...) and its fullest pipeline
rank fits in a GPU. Infeasible layouts keep the reason: validation's one-line message, or
which rank runs out of memory and by how much. Feasible layouts come first, fastest first.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from megatron3d.accounting.memory import Buffers, planned_buffers
from megatron3d.config import TrainConfig
from megatron3d.errors import ConfigError
from megatron3d.optim.batch_schedule import BatchSchedule
from megatron3d.planner.hardware import GIB, Cluster
from megatron3d.planner.layout import RECOMPUTE, Layout, Placement, placement
from megatron3d.planner.memory import RankMemory, rank_memory
from megatron3d.planner.timing import StepTime, step_time
from megatron3d.validation import layer_table, validate

PARTITION_METHODS = ("parameters", "uniform", "type:transformer|embedding")
MICRO_BATCH_SIZES = (1, 2, 4, 8)
VIRTUAL_SIZES = (1, 2, 4)


@dataclass(frozen=True)
class Fixed:
    """Dimensions the user chose; None is enumerated."""

    tp: int | None = None
    pp: int | None = None
    micro_batch_size: int | None = None
    zero_stage: int | None = None
    recompute: str | None = None
    partition_method: str | None = None
    virtual: int | None = None


@dataclass(frozen=True)
class Plan:
    """One layout judged: ``reason`` says why it is infeasible ("" when feasible);
    ``memory`` is the fullest rank and its index, ``time`` the step (both None when
    validation refused the layout)."""

    layout: Layout
    reason: str
    memory: RankMemory | None = None
    fullest_rank: int = 0
    time: StepTime | None = None

    @property
    def feasible(self) -> bool:
        return not self.reason

    def sort_key(self) -> tuple:
        seconds = self.time.iteration_s if self.time is not None else float("inf")
        return (not self.feasible, self.memory is None, seconds, self.layout)


def candidates(world_size: int, num_layers: int, gpus_per_node: int,
               fixed: Fixed) -> list[Layout]:
    """Every layout to judge: TP up to a node (and dividing the world), PP dividing what is
    left up to ``num_layers`` (the length of the layer list, embeddings and norms included),
    micro-batches 1..8, each ZeRO stage (only 0 without data parallelism), recompute,
    partition method and 2 or 4 model chunks per rank with pipelining; ``fixed`` dimensions
    are not enumerated."""
    layouts = []
    for tp in _choices(fixed.tp, [t for t in _divisors(world_size) if t <= gpus_per_node]):
        for pp in _choices(fixed.pp, [p for p in _divisors(world_size // tp)
                                      if p <= num_layers]):
            dp = world_size // (tp * pp)
            zero_stages = (0, 1, 3) if dp > 1 else (0,)
            virtuals = VIRTUAL_SIZES if pp > 1 else (1,)
            layouts += [Layout(tp, pp, dp, mbs, zero, recompute, method, v)
                        for mbs, zero, recompute, method, v in itertools.product(
                            _choices(fixed.micro_batch_size, MICRO_BATCH_SIZES),
                            _choices(fixed.zero_stage, zero_stages),
                            _choices(fixed.recompute, RECOMPUTE),
                            _choices(fixed.partition_method, PARTITION_METHODS),
                            _choices(fixed.virtual, virtuals))]
    return layouts


def _choices(fixed: int | str | None, options: list | tuple) -> list | tuple:
    return options if fixed is None else (fixed,)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


class Planner:
    """Judges layouts of one model on one cluster, remembering what layouts share (the ZeRO
    buffers of a rank, built on the meta device, depend on few of the choices)."""

    def __init__(self, cfg: TrainConfig, cluster: Cluster, device_type: str = "cuda") -> None:
        self.cfg, self.cluster, self.device_type = cfg, cluster, device_type
        self._buffers: dict[tuple, Buffers] = {}

    def plan(self, fixed: Fixed) -> list[Plan]:
        """Every candidate layout judged, feasible ones first, fastest first."""
        layers = len(layer_table(self.cfg.model)[0])
        return sorted((self.judge(layout) for layout in candidates(
            self.cluster.world_size, layers, self.cluster.gpus_per_node, fixed)),
            key=Plan.sort_key)

    def judge(self, layout: Layout) -> Plan:
        """``layout`` judged: validation first (its message is the reason), then the memory
        of every pipeline rank against a GPU's, and the step time."""
        cfg = layout.apply(self.cfg)
        try:
            validate(cfg, self.cluster.world_size)
        except ConfigError as err:
            return Plan(layout, str(err))
        where = placement(cfg)
        padded_vocab = cfg.model.padded_vocab_size(layout.tp)
        schedule = BatchSchedule.from_config(cfg.training, layout.dp)
        micro_batches = schedule.global_batch_size // schedule.samples_per_micro_batch_step
        ranks = [rank_memory(cfg, self._rank_buffers(cfg, layout, where, r), layout.dp, r,
                             micro_batches, where.chunk_names(r), padded_vocab,
                             self.device_type) for r in range(layout.pp)]
        fullest = max(range(layout.pp), key=lambda r: ranks[r].total)
        time = step_time(cfg, layout, where, self.cluster, padded_vocab)
        memory = ranks[fullest]
        reason = ""
        if memory.total > self.cluster.capacity_bytes:
            reason = (f"out of memory: pipeline rank {fullest} needs {memory.total / GIB:.1f} "
                      f"of {self.cluster.gpu_memory_gb:g} GiB (states "
                      f"{memory.states.total / GIB:.1f}, activations "
                      f"{memory.activations / GIB:.1f}, transients {memory.working / GIB:.1f})")
        return Plan(layout, reason, memory, fullest, time)

    def _rank_buffers(self, cfg: TrainConfig, layout: Layout, where: Placement,
                      rank: int) -> Buffers:
        """``planned_buffers`` of a rank, shared by ranks and layouts holding the same kinds
        of layers under the same parameter layout."""
        model = dataclasses.replace(cfg.model, checkpoint_activations=False,
                                    recompute_granularity=None)
        parallel = cfg.parallel
        key = (model, cfg.precision.params_dtype_name, layout.tp, layout.dp,
               parallel.zero_stage, parallel.reduce_bucket_size, parallel.live_units,
               parallel.reshard_after_forward, parallel.sequence_parallel,
               tuple(where.chunk_names(rank)))
        if key not in self._buffers:
            self._buffers[key] = planned_buffers(cfg, layout.tp, layout.dp,
                                                 list(where.spans[rank]))
        return self._buffers[key]
