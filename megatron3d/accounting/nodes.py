"""ZeRO-3's data-parallel collectives of one step, by group, and the bytes they bring a rank
from its own node and from the others: what ``mpu.traffic.CrossNodeCounter`` counts on a run
(the logical algorithm: from each other member, its chunk), for the planner's time and its
"bytes across nodes per step" column.

The weights' replicas (DP x CP, ``D = n * k``) span ``n`` nodes of ``k`` each. For a stage
of ``N`` parameters and ``M`` micro-batches, with every unit gathered for each forward and
again for each backward (``--zero3-reshard-after-forward true``: the fetch plan keeps a unit
gathered when the next computation needs it too, and pinned tied weights once per step, so a
run gathers at most this much) or once per step (false):

- flat (``--zero3-shard-group world``): gathers and reduce-scatters over all D replicas;
- hybrid (``node``): both over the k replicas of a node, and once per step an all-reduce of
  the N/k shard gradients over the n nodes (fp32: they accumulate in fp32);
- secondary shard (``--zero3-secondary-shard node``, hpZ): the first gather of a step over
  the n nodes (primary slices, N/D each, into the node-local N/k), every gather over the node
  (the secondary copy, model dtype); each reduction reduce-scatters over the node (N -> N/k),
  then over the nodes (N/k -> N/D).

Quantized (``--zero3-quantize-weights``/``--zero3-quantize-grads``): int8 and one fp32 scale
per block of 256, ``QUANTIZED_BYTES`` per element, on the gathers that read the primary
shards and on the gradient hop that crosses nodes.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

from megatron3d.accounting.memory import Buffers
from megatron3d.config import ParallelConfig, TrainConfig
from megatron3d.mpu.topology import Topology

FP32 = 4
QUANT_BLOCK = 256
QUANTIZED_BYTES = 1 + FP32 / QUANT_BLOCK
"""Bytes per element of an int8 payload with one fp32 scale per block."""


@dataclass(frozen=True)
class Nodes:
    """How the weights' replicas sit: ``count`` nodes of ``per_node`` each."""

    count: int
    per_node: int

    @property
    def replicas(self) -> int:
        return self.count * self.per_node


def replica_nodes(parallel: ParallelConfig, replicas: int, ranks_per_node: int) -> Nodes:
    """Where the ``replicas`` (DP x CP) of every weight shard sit on nodes of
    ``ranks_per_node`` ranks, as ``ParallelState`` cuts them (``ConfigError`` when a node
    holds more of them than another)."""
    return _replica_nodes(parallel.tensor_model_parallel_size,
                          parallel.pipeline_model_parallel_size, parallel.context_parallel_size,
                          replicas, ranks_per_node)


@functools.cache
def _replica_nodes(tp: int, pp: int, cp: int, replicas: int, ranks_per_node: int) -> Nodes:
    """Cached: the planner asks for every layout it judges, and cutting the whole world's
    groups is most of the cost."""
    topology = Topology(world_size=tp * pp * replicas, tp=tp, pp=pp, cp=cp)
    intra, inter = topology.node_split(topology.dp_cp_groups(), ranks_per_node)
    return Nodes(count=len(inter[0]), per_node=len(intra[0]))


def node_buffers(cfg: TrainConfig, replicas: int, nodes: Nodes,
                 flat: Callable[[TrainConfig, int], Buffers]) -> Buffers:
    """A rank's ZeRO buffers under the node-aware ZeRO-3, from ``flat`` (its buffers under
    flat ZeRO-3 at a number of replicas): hybrid shards over the node's replicas only;
    the secondary shard adds 1/k of the stage's (padded) parameters in the model dtype."""
    parallel = cfg.parallel
    plain = dataclasses.replace(cfg, parallel=dataclasses.replace(
        parallel, zero3_shard_group="world", zero3_secondary_shard="none"))
    if parallel.zero3_shard_group == "node":
        return flat(plain, nodes.per_node)
    buffers = flat(plain, replicas)
    if parallel.zero3_secondary_shard == "node":
        return dataclasses.replace(buffers, secondary=buffers.flat // nodes.per_node)
    return buffers


@dataclass(frozen=True)
class Collective:
    """One kind of collective of a step. group: "dp_cp" (every replica), "dp_intra" (the
    node's), "dp_inter" (one per node); phase: "forward" or "backward" (per micro-batch,
    overlapped with compute) or "step" (once, after the last backward); times: per step;
    numel: elements of the whole tensor (a gather's output, a reduction's input)."""

    kind: str
    group: str
    phase: str
    times: int
    numel: float
    element_bytes: float

    @property
    def nbytes(self) -> float:
        return self.numel * self.element_bytes


@dataclass(frozen=True)
class Traffic:
    """Bytes a rank receives in a step from ranks on its node and on other nodes."""

    intra: float
    inter: float


def zero3_collectives(numel: float, parallel: ParallelConfig, nodes: Nodes,
                      micro_batches: int, param_bytes: int) -> list[Collective]:
    """The data-parallel collectives of a step of a ZeRO-3 stage of ``numel`` parameters
    (none with one replica)."""
    if nodes.replicas == 1:
        return []
    per_micro = parallel.reshard_after_forward
    gathers = micro_batches if per_micro else 1  # each forward's; as many backward
    regathers = micro_batches if per_micro else 0
    reductions = micro_batches if per_micro else 1
    wire = 2 if parallel.grad_reduce_in_bf16 else FP32
    weights = QUANTIZED_BYTES if parallel.zero3_quantize_weights else param_bytes
    grads = QUANTIZED_BYTES if parallel.zero3_quantize_grads else wire
    k = nodes.per_node
    if parallel.zero3_shard_group == "node":
        return [Collective("all_gather", "dp_intra", "forward", gathers, numel, weights),
                Collective("all_gather", "dp_intra", "backward", regathers, numel, weights),
                Collective("reduce_scatter", "dp_intra", "backward", reductions, numel, wire),
                Collective("all_reduce", "dp_inter", "step", 1, numel / k,
                           QUANTIZED_BYTES if parallel.zero3_quantize_grads else FP32)]
    if parallel.zero3_secondary_shard == "node":
        return [Collective("all_gather", "dp_inter", "forward", 1, numel / k, weights),
                Collective("all_gather", "dp_intra", "forward", gathers, numel, param_bytes),
                Collective("all_gather", "dp_intra", "backward", regathers, numel, param_bytes),
                Collective("reduce_scatter", "dp_intra", "backward", reductions, numel, wire),
                Collective("reduce_scatter", "dp_inter", "backward", reductions, numel / k,
                           grads)]
    return [Collective("all_gather", "dp_cp", "forward", gathers, numel, weights),
            Collective("all_gather", "dp_cp", "backward", regathers, numel, weights),
            Collective("reduce_scatter", "dp_cp", "backward", reductions, numel, grads)]


def group_size(group: str, nodes: Nodes) -> int:
    return {"dp_cp": nodes.replicas, "dp_intra": nodes.per_node, "dp_inter": nodes.count}[group]


def received(collectives: list[Collective], nodes: Nodes) -> Traffic:
    """What ``collectives`` bring a rank per step: from each other member of the group, 1/size
    of the tensor (twice for an all-reduce: its reduce-scatter, then its all-gather)."""
    here = {"dp_cp": nodes.per_node - 1, "dp_intra": nodes.per_node - 1, "dp_inter": 0}
    elsewhere = {"dp_cp": nodes.replicas - nodes.per_node, "dp_intra": 0,
                 "dp_inter": nodes.count - 1}
    intra = inter = 0.0
    for c in collectives:
        share = c.times * c.nbytes / group_size(c.group, nodes) * (
            2 if c.kind == "all_reduce" else 1)
        intra += share * here[c.group]
        inter += share * elsewhere[c.group]
    return Traffic(intra, inter)
