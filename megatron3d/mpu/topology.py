"""Pure rank-grid math for a (TP, DP, PP) layout; no processes, no torch.distributed.

Megatron's order: tensor-parallel ranks are consecutive (inside a node, where bandwidth is
highest), then data-parallel, then pipeline-parallel:
``rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank``.
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


@dataclass(frozen=True)
class Topology:
    """The rank grid of ``world_size`` processes split into tp x dp x pp (dp derived)."""

    world_size: int
    tp: int
    pp: int

    def __post_init__(self) -> None:
        for label, value in (("world size", self.world_size), ("tensor-parallel size", self.tp),
                             ("pipeline-parallel size", self.pp)):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{label} must be an integer >= 1, got {value!r}; "
                                  "set it to a positive integer")
        if self.world_size % (self.tp * self.pp) != 0:
            raise ConfigError(
                f"world size {self.world_size} is not divisible by tp*pp = {self.tp * self.pp} "
                f"(tp={self.tp}, pp={self.pp}); launch a multiple of {self.tp * self.pp} "
                "processes or change --tensor-model-parallel-size/--pipeline-model-parallel-size")

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)

    def coords(self, rank: int) -> Coords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of size {self.world_size}")
        return Coords(tp_rank=rank % self.tp, dp_rank=(rank // self.tp) % self.dp,
                      pp_rank=rank // (self.tp * self.dp))

    def rank_of(self, tp_rank: int, dp_rank: int, pp_rank: int) -> int:
        if not (0 <= tp_rank < self.tp and 0 <= dp_rank < self.dp and 0 <= pp_rank < self.pp):
            raise ValueError(f"coordinates (tp={tp_rank}, dp={dp_rank}, pp={pp_rank}) outside "
                             f"grid tp={self.tp} dp={self.dp} pp={self.pp}")
        return pp_rank * (self.dp * self.tp) + dp_rank * self.tp + tp_rank

    def tp_groups(self) -> RankGroups:
        """Ranks sharing (dp, pp): they split each layer's weights."""
        return [tuple(self.rank_of(t, d, p) for t in range(self.tp))
                for p in range(self.pp) for d in range(self.dp)]

    def dp_groups(self) -> RankGroups:
        """Ranks sharing (tp, pp): replicas of the same weight shard, gradients averaged."""
        return [tuple(self.rank_of(t, d, p) for d in range(self.dp))
                for p in range(self.pp) for t in range(self.tp)]

    def pp_groups(self) -> RankGroups:
        """Ranks sharing (tp, dp): the stages one micro-batch flows through."""
        return [tuple(self.rank_of(t, d, p) for p in range(self.pp))
                for d in range(self.dp) for t in range(self.tp)]

    def model_parallel_groups(self) -> RankGroups:
        """Ranks sharing dp: together they hold one full copy of the model."""
        return [tuple(sorted(self.rank_of(t, d, p) for p in range(self.pp) for t in range(self.tp)))
                for d in range(self.dp)]

    def embedding_groups(self) -> RankGroups:
        """First and last stage of each pipeline: they all-reduce the tied embedding's grad."""
        return [(g[0], g[-1]) if self.pp > 1 else (g[0],) for g in self.pp_groups()]

    def table(self) -> str:
        """Human-readable rank grid and group lists, printed once at start-up."""
        lines = [f"world {self.world_size} = tp {self.tp} x dp {self.dp} x pp {self.pp} "
                 f"(rank = pp_rank*{self.dp * self.tp} + dp_rank*{self.tp} + tp_rank)",
                 " rank   tp   dp   pp"]
        lines += [f"{r:5d}{c.tp_rank:5d}{c.dp_rank:5d}{c.pp_rank:5d}"
                  for r in range(self.world_size) for c in (self.coords(r),)]
        for label, groups in (("tp", self.tp_groups()), ("dp", self.dp_groups()),
                              ("pp", self.pp_groups()), ("model", self.model_parallel_groups()),
                              ("embedding", self.embedding_groups())):
            lines.append(f"{label} groups: " + " ".join(str(list(g)) for g in groups))
        return "\n".join(lines)
