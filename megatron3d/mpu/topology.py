"""Pure rank-grid math for a (TP, CP, DP, PP) layout; no processes, no torch.distributed.

Megatron's order: tensor-parallel ranks are consecutive (inside a node, where bandwidth is
highest), then context-parallel (their attention exchanges keys and values every layer),
then data-parallel, then pipeline-parallel:
``rank = pp_rank * (dp * cp * tp) + dp_rank * (cp * tp) + cp_rank * tp + tp_rank``.
Without context parallelism (cp = 1) that is ``pp_rank * (dp * tp) + dp_rank * tp + tp_rank``.
Every group list below is deterministic, so all ranks create process groups in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from megatron3d.errors import ConfigError

RankGroups = list[tuple[int, ...]]


class Coords(NamedTuple):
    """Where one rank sits in the grid."""

    tp_rank: int
    dp_rank: int
    pp_rank: int
    cp_rank: int = 0


@dataclass(frozen=True)
class Topology:
    """The rank grid of ``world_size`` processes split into tp x cp x dp x pp (dp derived).

    Context-parallel ranks split each sequence; for the parameters they are replicas like
    data-parallel ranks, so ZeRO shards and gradients are reduced over ``dp_cp_groups``."""

    world_size: int
    tp: int
    pp: int
    cp: int = 1

    def __post_init__(self) -> None:
        for label, value in (("world size", self.world_size), ("tensor-parallel size", self.tp),
                             ("pipeline-parallel size", self.pp),
                             ("context-parallel size", self.cp)):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{label} must be an integer >= 1, got {value!r}; "
                                  "set it to a positive integer")
        model = self.tp * self.cp * self.pp
        if self.world_size % model != 0:
            cp = f", cp={self.cp}" if self.cp > 1 else ""
            flag = "/--context-parallel-size" if self.cp > 1 else ""
            raise ConfigError(
                f"world size {self.world_size} is not divisible by tp*{'cp*' if cp else ''}pp "
                f"= {model} (tp={self.tp}{cp}, pp={self.pp}); launch a multiple of {model} "
                "processes or change --tensor-model-parallel-size/--pipeline-model-parallel-size"
                f"{flag}")

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.cp * self.pp)

    def coords(self, rank: int) -> Coords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of size {self.world_size}")
        return Coords(tp_rank=rank % self.tp, dp_rank=(rank // (self.tp * self.cp)) % self.dp,
                      pp_rank=rank // (self.tp * self.cp * self.dp),
                      cp_rank=(rank // self.tp) % self.cp)

    def rank_of(self, tp_rank: int, dp_rank: int, pp_rank: int, cp_rank: int = 0) -> int:
        if not (0 <= tp_rank < self.tp and 0 <= dp_rank < self.dp and 0 <= pp_rank < self.pp
                and 0 <= cp_rank < self.cp):
            raise ValueError(f"coordinates (tp={tp_rank}, cp={cp_rank}, dp={dp_rank}, "
                             f"pp={pp_rank}) outside grid tp={self.tp} cp={self.cp} "
                             f"dp={self.dp} pp={self.pp}")
        return ((pp_rank * self.dp + dp_rank) * self.cp + cp_rank) * self.tp + tp_rank

    def _cells(self) -> list[tuple[int, int, int]]:
        """Every (pp, dp, cp) coordinate, in rank order."""
        return [(p, d, c) for p in range(self.pp) for d in range(self.dp) for c in range(self.cp)]

    def tp_groups(self) -> RankGroups:
        """Ranks sharing (cp, dp, pp): they split each layer's weights."""
        return [tuple(self.rank_of(t, d, p, c) for t in range(self.tp))
                for p, d, c in self._cells()]

    def cp_groups(self) -> RankGroups:
        """Ranks sharing (tp, dp, pp): they split each sequence of the same micro-batches."""
        return [tuple(self.rank_of(t, d, p, c) for c in range(self.cp))
                for p in range(self.pp) for d in range(self.dp) for t in range(self.tp)]

    def dp_groups(self) -> RankGroups:
        """Ranks sharing (tp, cp, pp): they read different samples (the data axis)."""
        return [tuple(self.rank_of(t, d, p, c) for d in range(self.dp))
                for p in range(self.pp) for c in range(self.cp) for t in range(self.tp)]

    def dp_cp_groups(self) -> RankGroups:
        """Ranks sharing (tp, pp): replicas of the same weight shard, gradients averaged (the
        data-parallel ranks of every context-parallel rank; ``dp_groups`` when cp = 1)."""
        return [tuple(self.rank_of(t, d, p, c) for d in range(self.dp) for c in range(self.cp))
                for p in range(self.pp) for t in range(self.tp)]

    def pp_groups(self) -> RankGroups:
        """Ranks sharing (tp, cp, dp): the stages one micro-batch flows through."""
        return [tuple(self.rank_of(t, d, p, c) for p in range(self.pp))
                for d in range(self.dp) for c in range(self.cp) for t in range(self.tp)]

    def model_parallel_groups(self) -> RankGroups:
        """Ranks sharing (cp, dp): together they hold one full copy of the model."""
        return [tuple(sorted(self.rank_of(t, d, p, c) for p in range(self.pp)
                             for t in range(self.tp)))
                for d in range(self.dp) for c in range(self.cp)]

    def embedding_groups(self) -> RankGroups:
        """First and last stage of each pipeline: they all-reduce the tied embedding's grad."""
        return [(g[0], g[-1]) if self.pp > 1 else (g[0],) for g in self.pp_groups()]

    def node_split(self, groups: RankGroups,
                   ranks_per_node: int) -> tuple[RankGroups, RankGroups]:
        """Each group's members cut by node (rank // ``ranks_per_node``, as torchrun numbers
        them): the intra-node subgroups (members sharing a node) and the inter-node ones
        (the i-th member of each node's part, one per node), both in group order. Every
        node must hold the same number of each group's members."""
        if ranks_per_node < 1 or self.world_size % ranks_per_node:
            raise ConfigError(f"{ranks_per_node} ranks per node do not split the world of "
                              f"{self.world_size}; give --gpus-per-node dividing the world "
                              "size (or launch the same ranks on every node)")
        intra: RankGroups = []
        inter: RankGroups = []
        for group in groups:
            parts: dict[int, list[int]] = {}
            for rank in group:
                parts.setdefault(rank // ranks_per_node, []).append(rank)
            sizes = {len(part) for part in parts.values()}
            if len(sizes) != 1:
                raise ConfigError(
                    f"ranks {list(group)} are spread unevenly over nodes of {ranks_per_node} "
                    f"ranks ({sorted(len(p) for p in parts.values())} per node); the "
                    "node-aware ZeRO-3 needs each node to hold as many of them: change "
                    "--gpus-per-node or the layout")
            ordered = [parts[node] for node in sorted(parts)]
            intra += [tuple(part) for part in ordered]
            inter += [tuple(part[i] for part in ordered) for i in range(sizes.pop())]
        return intra, inter

    def table(self) -> str:
        """Human-readable rank grid and group lists, printed once at start-up."""
        if self.cp == 1:
            lines = [f"world {self.world_size} = tp {self.tp} x dp {self.dp} x pp {self.pp} "
                     f"(rank = pp_rank*{self.dp * self.tp} + dp_rank*{self.tp} + tp_rank)",
                     " rank   tp   dp   pp"]
            lines += [f"{r:5d}{c.tp_rank:5d}{c.dp_rank:5d}{c.pp_rank:5d}"
                      for r in range(self.world_size) for c in (self.coords(r),)]
        else:
            lines = [f"world {self.world_size} = tp {self.tp} x cp {self.cp} x dp {self.dp} x "
                     f"pp {self.pp} (rank = pp_rank*{self.dp * self.cp * self.tp} + "
                     f"dp_rank*{self.cp * self.tp} + cp_rank*{self.tp} + tp_rank)",
                     " rank   tp   cp   dp   pp"]
            lines += [f"{r:5d}{c.tp_rank:5d}{c.cp_rank:5d}{c.dp_rank:5d}{c.pp_rank:5d}"
                      for r in range(self.world_size) for c in (self.coords(r),)]
        axes = [("tp", self.tp_groups())]
        if self.cp > 1:
            axes += [("cp", self.cp_groups()), ("dp", self.dp_groups()),
                     ("dp-cp", self.dp_cp_groups())]
        else:
            axes += [("dp", self.dp_groups())]
        axes += [("pp", self.pp_groups()), ("model", self.model_parallel_groups()),
                 ("embedding", self.embedding_groups())]
        for label, groups in axes:
            lines.append(f"{label} groups: " + " ".join(str(list(g)) for g in groups))
        return "\n".join(lines)
