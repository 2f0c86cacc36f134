"""Where a layout's layers go: each pipeline rank's model chunks as ranges of the layer list,
computed by the partitioner on the real layer list as ``build_engine`` does, without
building anything (the memory model, the start-up fit check and the planner read it)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from megatron3d.config import TrainConfig
from megatron3d.model.gpt import layer_table, stage_bounds


@dataclass(frozen=True)
class Placement:
    """The layers of each pipeline rank: ``spans[r][c]`` is rank r's chunk c as a range of
    ``gpt_layer_specs`` (virtual stage c * PP + r), ``names`` every layer's type name."""

    names: tuple[str, ...]
    spans: tuple[tuple[tuple[int, int], ...], ...]

    def chunk_names(self, rank: int) -> list[tuple[str, ...]]:
        return [self.names[a:b] for a, b in self.spans[rank]]

    @property
    def virtual_stages(self) -> list[tuple[str, ...]]:
        """Type names of every virtual stage, in pipeline order."""
        ranks, chunks = len(self.spans), len(self.spans[0])
        return [self.names[slice(*self.spans[r][c])] for c in range(chunks) for r in range(ranks)]


def placement(cfg: TrainConfig) -> Placement:
    """Where ``cfg``'s layers go (``cfg`` must have passed validation)."""
    parallel = cfg.parallel
    p, v = parallel.pipeline_model_parallel_size, parallel.virtual_size(cfg.model.num_layers)
    stages = list(itertools.pairwise(stage_bounds(
        cfg.model, p, parallel.pp_partition_method, v,
        parallel.num_layers_per_virtual_pipeline_stage)))
    names = layer_table(cfg.model)[0]
    return Placement(names, tuple(tuple(stages[c * p + r] for c in range(v)) for r in range(p)))
