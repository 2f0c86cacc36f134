"""The parallel state: one explicit object holding this rank's process groups.

Built once after ``init_process_group`` and passed to whoever needs it; callees take the
narrowest ``AxisGroup`` they need (a TP layer gets ``state.tp``), so nothing reads
module-level process-group globals. ``single()`` variants let one process run the same code
without torch.distributed (collectives on size-1 axes are no-ops in ``comm``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

import torch.distributed as dist

from megatron3d.mpu.topology import RankGroups, Topology


class LayoutFlags(Protocol):
    """What ``ParallelState.for_config`` reads of ``config.ParallelConfig`` (``mpu`` sits
    below ``config``'s importers on the floor plan)."""

    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    context_parallel_size: int
    gpus_per_node: int
    node_aware_zero3: bool


@dataclass(frozen=True)
class AxisGroup:
    """This rank's view of one parallel axis.

    group: the process group, or None for a single-process axis (and for a rank outside an
        optional group such as the embedding group, where size is 0 and rank is -1).
    rank: index of this process inside ``ranks``.
    size: number of members.
    ranks: global ranks of the members, in axis order.
    name: which axis ("tp", "pp", ...): tells two groups with the same members apart in
        hang dumps.
    reverse: a second group over the same members, carrying the point-to-point transfers
        towards a lower index while ``group`` carries those towards a higher one: each
        direction of a pipeline link then has its own NCCL communicator and stream
        (``comm.start_exchange``). A pipeline axis of size > 1 has one except on gloo; None
        elsewhere.
    """

    group: dist.ProcessGroup | None
    rank: int
    size: int
    ranks: tuple[int, ...]
    name: str = ""
    reverse: dist.ProcessGroup | None = None

    @classmethod
    def single(cls, world_rank: int = 0) -> AxisGroup:
        """A size-1 axis containing only this process; needs no torch.distributed."""
        return cls(group=None, rank=0, size=1, ranks=(world_rank,))

    @classmethod
    def absent(cls) -> AxisGroup:
        """The view of a rank that is not a member of the group (size 0)."""
        return cls(group=None, rank=-1, size=0, ranks=())

    @property
    def is_member(self) -> bool:
        return self.size > 0


@dataclass(frozen=True)
class ParallelState:
    """All groups of this rank: tp, pp, dp, model-parallel (tp x pp), embedding, and the
    context-parallel ones: cp (ranks splitting one sequence) and dp_cp (dp x cp: the ranks
    holding replicas of the same weights, over which ZeRO shards and gradients are averaged;
    the same members as dp when cp = 1), and dp_cp cut by node (dp_intra, dp_inter) for the
    node-aware ZeRO-3; ranks_per_node: ranks on each node, as launched."""

    tp: AxisGroup
    pp: AxisGroup
    dp: AxisGroup
    mp: AxisGroup
    embedding: AxisGroup
    world_rank: int
    world_size: int
    topology: Topology
    cp: AxisGroup
    dp_cp: AxisGroup
    dp_intra: AxisGroup
    dp_inter: AxisGroup
    ranks_per_node: int

    @classmethod
    def single(cls) -> ParallelState:
        """One process, no torch.distributed: every axis has size 1."""
        one = AxisGroup.single()
        return cls(tp=one, pp=one, dp=one, mp=one, embedding=one, world_rank=0, world_size=1,
                   topology=Topology(world_size=1, tp=1, pp=1), cp=one, dp_cp=one,
                   dp_intra=one, dp_inter=one, ranks_per_node=1)

    @classmethod
    def build(cls, tp_size: int, pp_size: int, *, cp_size: int = 1,
              directed_links: bool | None = None, ranks_per_node: int | None = None,
              node_groups: bool = False) -> ParallelState:
        """Create every group of the layout; a collective call: all ranks must make it.

        ``dist.new_group`` must be called by every rank for every group in the same order,
        including groups the rank is not in, so the loops below never depend on the rank.
        ``directed_links``: give the pipeline axis its ``reverse`` group (default: on every
        backend but gloo, whose batches already give each transfer its own work; tests set it
        to run NCCL's posting on gloo). ``ranks_per_node``: as torchrun numbers ranks
        (default: the whole world is one node); with ``node_groups`` the weight replicas
        (``dp_cp``) are also cut into ``dp_intra`` (the members on this rank's node) and
        ``dp_inter`` (this rank's counterparts on the other nodes), for the node-aware
        ZeRO-3; without, ``dp_intra`` is ``dp_cp`` and ``dp_inter`` a size-1 axis.
        """
        if not dist.is_initialized():
            raise RuntimeError("ParallelState.build needs torch.distributed initialised; "
                               "use ParallelState.single() for one process")
        world_rank, world_size = dist.get_rank(), dist.get_world_size()
        topo = Topology(world_size=world_size, tp=tp_size, pp=pp_size, cp=cp_size)
        if directed_links is None:
            directed_links = dist.get_backend() != "gloo"
        axes = {name: _create_groups(name, groups, world_rank, name == "pp" and directed_links
                                     and pp_size > 1) for name, groups in (
            ("tp", topo.tp_groups()), ("pp", topo.pp_groups()), ("dp", topo.dp_groups()),
            ("mp", topo.model_parallel_groups()), ("embedding", topo.embedding_groups()))}
        if cp_size > 1:  # only then: a run without CP creates exactly the groups it did
            axes["cp"] = _create_groups("cp", topo.cp_groups(), world_rank)
            axes["dp_cp"] = _create_groups("dp_cp", topo.dp_cp_groups(), world_rank)
        else:
            axes["cp"] = AxisGroup.single(world_rank)
            axes["dp_cp"] = axes["dp"]
        per_node = ranks_per_node or world_size
        if node_groups:
            intra, inter = topo.node_split(topo.dp_cp_groups(), per_node)
            axes["dp_intra"] = _create_groups("dp_intra", intra, world_rank)
            axes["dp_inter"] = _create_groups("dp_inter", inter, world_rank)
        else:
            axes["dp_intra"], axes["dp_inter"] = axes["dp_cp"], AxisGroup.single(world_rank)
        return cls(**axes, world_rank=world_rank, world_size=world_size, topology=topo,
                   ranks_per_node=per_node)

    @classmethod
    def for_config(cls, parallel: LayoutFlags,
                   directed_links: bool | None = None) -> ParallelState:
        """``build`` for a run's ``--tensor-model-parallel-size`` & co.: ranks per node from
        ``--gpus-per-node`` or the launcher, node groups when ZeRO-3 is node-aware."""
        return cls.build(parallel.tensor_model_parallel_size,
                         parallel.pipeline_model_parallel_size,
                         cp_size=parallel.context_parallel_size, directed_links=directed_links,
                         ranks_per_node=ranks_per_node(parallel.gpus_per_node,
                                                       dist.get_world_size()),
                         node_groups=parallel.node_aware_zero3)

    @property
    def world(self) -> AxisGroup:
        """Every rank (checkpoint barriers, agreeing to stop)."""
        if self.world_size == 1:
            return AxisGroup.single(self.world_rank)
        return AxisGroup(group=dist.group.WORLD, rank=self.world_rank, size=self.world_size,
                         ranks=tuple(range(self.world_size)), name="world")

    @property
    def is_first_stage(self) -> bool:
        return self.pp.rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp.rank == self.pp.size - 1

    @property
    def in_embedding_group(self) -> bool:
        return self.embedding.is_member


def ranks_per_node(given: int, world_size: int) -> int:
    """Ranks on each node: ``--gpus-per-node`` when given (> 0), else LOCAL_WORLD_SIZE (as
    torchrun sets it), else the whole world (one node)."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if given > 0:
        return given
    return int(local) if local.isdigit() and 0 < int(local) <= world_size else world_size


def _create_groups(name: str, groups: RankGroups, world_rank: int,
                   reverse: bool = False) -> AxisGroup:
    """Call new_group for every member list (twice with ``reverse``); return this rank's view
    of its own group."""
    mine = AxisGroup.absent()
    for ranks in groups:
        group = dist.new_group(list(ranks))
        second = dist.new_group(list(ranks)) if reverse else None
        if world_rank in ranks:
            mine = AxisGroup(group=group, rank=ranks.index(world_rank), size=len(ranks),
                             ranks=ranks, name=name, reverse=second)
    return mine
