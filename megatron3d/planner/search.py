"""Enumerate layouts for a model on a cluster, judge each with the framework's own rules and
the memory and time models, and rank them.

A layout is feasible when ``validation.validate`` accepts it (the very checks
``pretrain_gpt.py`` runs: the rank grid, divisibility, the whole batch rampup, the
interleaved schedule, the partitioner on the real layer list, ...) and the peak of its
fullest pipeline rank, over build, training, evaluation and save, leaves
``--memory-headroom`` of a GPU free (``accounting/fit.py``: the start-up check's own test).
Infeasible layouts keep the reason: validation's one-line message, or which rank runs out of
memory, in which phase and by how much. Feasible layouts come first, fastest first.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

from megatron3d.accounting.fit import fullest, layout_memory, shortfall
from megatron3d.accounting.memory import Buffers, planned_buffers
from megatron3d.accounting.nodes import Nodes, node_buffers, replica_nodes
from megatron3d.accounting.peak import RankMemory
from megatron3d.accounting.placement import Placement, placement
from megatron3d.config import TrainConfig
from megatron3d.errors import ConfigError
from megatron3d.model.gpt import layer_table
from megatron3d.planner.hardware import Cluster
from megatron3d.planner.layout import RECOMPUTE, ZERO3_MODES, Layout
from megatron3d.planner.timing import StepTime, step_time
from megatron3d.validation import validate

PARTITION_METHODS = ("parameters", "uniform", "type:transformer|embedding")
MICRO_BATCH_SIZES = (1, 2, 4, 8)
VIRTUAL_SIZES = (1, 2, 4)
CONTEXT_PARALLEL_SIZES = (1, 2, 4, 8)
LONG_SEQUENCE = 8192
"""Context parallelism is searched from this sequence length on (below it a sequence's
activations are small and splitting it only adds exchanges); ``--context-parallel-size``
fixes it at any length."""


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
    sequence_parallel: bool | None = None
    cp: int | None = None
    cp_comm_type: str = "p2p"  # not searched: the exchange the user runs
    zero3_mode: str | None = None


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


def candidates(world_size: int, num_layers: int, gpus_per_node: int, fixed: Fixed,
               seq_length: int = 0) -> list[Layout]:
    """Every layout to judge: TP up to a node (and dividing the world), CP 1, 2, 4 or 8 for
    sequences of ``LONG_SEQUENCE`` tokens or more (cutting into 2 CP equal chunks), PP
    dividing what is left up to ``num_layers`` (the length of the layer list, embeddings and
    norms included), micro-batches 1..8, each ZeRO stage (only 0 without replicas of the
    weights, DP x CP; ZeRO-3 also hybrid and with a secondary shard when the replicas span
    nodes), recompute (none, selective, full), partition method, 2 or 4 model chunks per
    rank with pipelining, and sequence parallelism with TP; ``fixed`` dimensions are not
    enumerated."""
    layouts = []
    long = seq_length >= LONG_SEQUENCE
    for tp in _choices(fixed.tp, [t for t in _divisors(world_size) if t <= gpus_per_node]):
        for cp in _choices(fixed.cp, [c for c in CONTEXT_PARALLEL_SIZES if c == 1 or (
                long and (world_size // tp) % c == 0 and seq_length % (2 * c) == 0)]):
            layouts += _with(world_size, tp, cp, num_layers, fixed, gpus_per_node)
    return layouts


def _with(world_size: int, tp: int, cp: int, num_layers: int, fixed: Fixed,
          gpus_per_node: int) -> list[Layout]:
    """``candidates`` at one TP and CP size."""
    layouts = []
    for pp in _choices(fixed.pp, [p for p in _divisors(world_size // (tp * cp))
                                  if p <= num_layers]):
        dp = world_size // (tp * cp * pp)
        zero_stages = (0, 1, 3) if dp * cp > 1 else (0,)
        virtuals = VIRTUAL_SIZES if pp > 1 else (1,)
        sequence = (False, True) if tp > 1 else (False,)
        spans_nodes = tp * cp * dp > gpus_per_node  # the replicas of rank 0's shard do
        modes = ZERO3_MODES if spans_nodes else ("flat",)
        layouts += [Layout(tp, pp, dp, mbs, zero, recompute, method, v, sp, cp,
                           fixed.cp_comm_type, mode)
                    for mbs, (zero, mode), recompute, method, v, sp in itertools.product(
                        _choices(fixed.micro_batch_size, MICRO_BATCH_SIZES),
                        [(z, m) for z in _choices(fixed.zero_stage, zero_stages)
                         for m in (_choices(fixed.zero3_mode, modes) if z == 3 else ("flat",))],
                        _choices(fixed.recompute, RECOMPUTE),
                        _choices(fixed.partition_method, PARTITION_METHODS),
                        _choices(fixed.virtual, virtuals),
                        _choices(fixed.sequence_parallel, sequence))]
    return layouts


def _choices(fixed: int | str | None, options: list | tuple) -> list | tuple:
    return options if fixed is None else (fixed,)


def _divisors(n: int) -> list[int]:
    """In increasing order, in about sqrt(n) steps."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


class Planner:
    """Judges layouts of one model on one cluster, remembering what layouts share (the ZeRO
    buffers of a rank, built on the meta device, depend on few of the choices)."""

    def __init__(self, cfg: TrainConfig, cluster: Cluster, device_type: str = "cuda") -> None:
        self.cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(
            cfg.parallel, gpus_per_node=cluster.gpus_per_node))
        self.cluster, self.device_type = cluster, device_type
        self._buffers: dict[tuple, Buffers] = {}

    def plan(self, fixed: Fixed) -> list[Plan]:
        """Every candidate layout judged, feasible ones first, fastest first."""
        layers = len(layer_table(self.cfg.model)[0])
        return sorted((self.judge(layout) for layout in candidates(
            self.cluster.world_size, layers, self.cluster.gpus_per_node, fixed,
            self.cfg.model.seq_length)), key=Plan.sort_key)

    def judge(self, layout: Layout) -> Plan:
        """``layout`` judged: validation first (its message is the reason), then the peak
        memory of every pipeline rank against a GPU's less the headroom, and the step
        time."""
        cfg = layout.apply(self.cfg)
        try:
            validate(cfg, self.cluster.world_size)
            nodes = self._nodes(cfg, layout)
        except ConfigError as err:
            return Plan(layout, str(err))
        ranks = layout_memory(cfg, self.cluster.world_size, self.device_type,
                              self._rank_buffers)
        time = step_time(cfg, layout, placement(cfg), self.cluster,
                         cfg.model.padded_vocab_size(layout.tp), nodes)
        reason = shortfall(ranks, self.cluster.capacity_bytes, cfg.parallel.memory_headroom)
        r = fullest(ranks)
        return Plan(layout, reason, ranks[r], r, time)

    def _nodes(self, cfg: TrainConfig, layout: Layout) -> Nodes | None:
        """Where the layout's replicas sit; None for flat ZeRO spreading them unevenly
        (``ConfigError`` for the node-aware ZeRO-3: its groups need them even)."""
        try:
            return replica_nodes(cfg.parallel, layout.replicas, self.cluster.gpus_per_node)
        except ConfigError:
            if cfg.parallel.node_aware_zero3:
                raise
            return None

    def _rank_buffers(self, cfg: TrainConfig, dp: int, where: Placement, rank: int) -> Buffers:
        """A rank's buffers (``dp``: the weights' replicas, DP x CP), node-aware ZeRO-3's
        from flat ones (``nodes.node_buffers``)."""
        if not cfg.parallel.node_aware_zero3:
            return self._flat_buffers(cfg, dp, where, rank)
        nodes = replica_nodes(cfg.parallel, dp, self.cluster.gpus_per_node)
        return node_buffers(cfg, dp, nodes,
                            lambda plain, shards: self._flat_buffers(plain, shards, where, rank))

    def _flat_buffers(self, cfg: TrainConfig, dp: int, where: Placement, rank: int) -> Buffers:
        """``planned_buffers`` of a rank, shared by ranks and layouts holding the same kinds of
        layers under the same parameter layout (which neither recompute nor sequence
        parallelism changes, nor the replicas without ZeRO)."""
        model = dataclasses.replace(cfg.model, checkpoint_activations=False,
                                    recompute_granularity=None)
        parallel = cfg.parallel
        tp = parallel.tensor_model_parallel_size
        key = (model, cfg.precision.params_dtype_name, tp, dp if parallel.zero_stage else 1,
               parallel.zero_stage, parallel.reduce_bucket_size, parallel.live_units,
               parallel.reshard_after_forward, tuple(where.chunk_names(rank)))
        if key not in self._buffers:
            self._buffers[key] = planned_buffers(cfg, tp, dp, list(where.spans[rank]))
        return self._buffers[key]
