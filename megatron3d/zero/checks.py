"""The node-aware ZeRO-3 flags' combinations, refused in one line before any process starts
(``validation.validate`` asks here), and the layout's node warning.

Also the flags that belong to one ZeRO stage and the ZeRO-3 pool sizes. The data-parallel
ranks' split by node is checked where the groups are made (``Topology.node_split``), with
the same one-line form: it needs the launch's ranks per node (``device.ranks_per_node``).
"""

from __future__ import annotations

from megatron3d.config import ParallelConfig
from megatron3d.errors import ConfigError

_ZERO3_ONLY = ("zero3_quantize_weights", "zero3_quantize_grads")


def check_zero(parallel: ParallelConfig, world_size: int) -> None:
    """Raise ``ConfigError`` for the first ZeRO flag combination that cannot run: flags of
    another stage, the ZeRO-3 pool sizes, the node-aware ZeRO-3's combinations."""
    _check_stage_flags(parallel)
    stage = parallel.zero_stage
    named = [f"--zero3-shard-group {parallel.zero3_shard_group}"
             if parallel.zero3_shard_group != "world" else "",
             f"--zero3-secondary-shard {parallel.zero3_secondary_shard}"
             if parallel.zero3_secondary_shard != "none" else "",
             *(f"--{name.replace('_', '-')}" for name in _ZERO3_ONLY if getattr(parallel, name))]
    named = [n for n in named if n]
    if named and stage != 3:
        raise ConfigError(f"{named[0]} is a ZeRO-3 option (--zero-stage={stage}): pass "
                          "--zero-stage 3 or drop it")
    if parallel.zero3_shard_group == "node" and parallel.zero3_secondary_shard == "node":
        raise ConfigError("--zero3-shard-group node already keeps every shard in the node; "
                          "--zero3-secondary-shard node adds a node copy to world shards: "
                          "pass one of the two")
    if parallel.zero3_quantize_grads and parallel.grad_reduce_in_bf16:
        raise ConfigError("--zero3-quantize-grads sends the cross-node gradients as int8 "
                          "from fp32 (--grad-reduce-in-bf16=True): drop one of the two flags")
    if parallel.gpus_per_node and world_size % parallel.gpus_per_node:
        raise ConfigError(f"--gpus-per-node={parallel.gpus_per_node} does not divide the "
                          f"world of {world_size} ranks: give the ranks each node runs")


def _check_stage_flags(parallel: ParallelConfig) -> None:
    """Flags that belong to one ZeRO stage, and the ZeRO-3 pool sizes."""
    stage = parallel.zero_stage
    if parallel.overlap_param_gather and stage != 1:
        raise ConfigError(f"--overlap-param-gather is ZeRO-1's post-step parameter all-gather "
                          f"(--zero-stage={stage}): pass --zero-stage 1 or drop the flag "
                          "(ZeRO-3 prefetches with --zero3-prefetch-depth)")
    if parallel.grad_reduce_in_bf16 and parallel.accumulate_allreduce_grads_in_fp32:
        raise ConfigError("gradients cannot be reduced in both bf16 and fp32 "
                          "(--grad-reduce-in-bf16=True, "
                          "--accumulate-allreduce-grads-in-fp32=True): drop one of the two "
                          "flags")
    depth = parallel.zero3_prefetch_depth
    if depth < 0:
        raise ConfigError(f"must be >= 0 (--zero3-prefetch-depth={depth}): give 0 (no "
                          "prefetch) or more units to fetch ahead")
    if parallel.zero3_max_live_units < 0 or parallel.live_units < depth + 1:
        raise ConfigError("the ZeRO-3 pool must hold the unit computing plus every "
                          "prefetched one (--zero3-max-live-units="
                          f"{parallel.zero3_max_live_units}, --zero3-prefetch-depth={depth}): "
                          f"give --zero3-max-live-units >= {depth + 1} or 0 for that default")


def node_warnings(parallel: ParallelConfig, ranks_per_node: int) -> list[str]:
    """What the layout does across nodes that it should not: tensor parallelism exchanges
    activations in every layer and wants the node's links."""
    tp = parallel.tensor_model_parallel_size
    if tp > 1 and ranks_per_node % tp:
        return [f"tensor-parallel groups of {tp} cross nodes of {ranks_per_node} ranks: every "
                "layer's activations then travel between nodes; give a "
                "--tensor-model-parallel-size dividing the ranks per node"]
    return []
