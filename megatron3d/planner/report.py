"""What the planner prints: the ranked table, one JSON object per layout, and a summary."""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from megatron3d.accounting.model_size import model_size
from megatron3d.config import ModelConfig
from megatron3d.model.context import LayerContext
from megatron3d.mpu.state import AxisGroup
from megatron3d.planner.hardware import GIB, Cluster
from megatron3d.planner.search import Plan

_HEADER = (f"{'#':>4} {'TP':>3} {'SP':>2} {'CP':>2} {'PP':>3} {'DP':>4} {'MBS':>3} {'ZeRO':>4} "
           f"{'nodes':<9} {'recompute':<9} {'v':>2} {'partition':<26} {'GiB':>6} {'s/iter':>8} "
           f"{'TFLOPs':>7} {'bubble':>6} {'x-node':>8}  reason")
_MODE = {"flat": "-", "hybrid": "hybrid", "secondary": "secondary"}
"""The nodes column: ZeRO-3 sharded in the node (hybrid) or with a node-local secondary
shard."""


def model_parameters(model: ModelConfig) -> int:
    """The model's parameters, a tied embedding once, as the start-up log counts them."""
    return model_size(LayerContext(model, AxisGroup.single(), seed=0)).unique


def to_json(plan: Plan) -> dict[str, Any]:
    """The object ``--json`` writes for one layout (GiB, seconds, TFLOP/s per GPU; six
    significant digits), None where validation refused the layout before it was sized. The
    memory is the fullest pipeline rank's: its peak, the phase it comes from, every phase's
    peak, and the peak phase's parts (tensors by name, then the allocator's fragmentation,
    the CUDA context and the NCCL communicators); ZeRO-3's bytes a rank receives from other
    nodes per step (GB, ``accounting/nodes.py``)."""
    layout, memory, time = plan.layout, plan.memory, plan.time
    sized, timed = memory is not None, time is not None
    peak = memory.peak if sized else None
    return {
        "tp": layout.tp, "pp": layout.pp, "dp": layout.dp,
        "micro_batch_size": layout.micro_batch_size, "zero_stage": layout.zero_stage,
        "checkpoint_activations": layout.checkpoint_activations,
        "recompute": layout.recompute, "partition_method": layout.partition_method,
        "virtual_pipeline_model_parallel_size": layout.virtual,
        "sequence_parallel": layout.sequence_parallel,
        "context_parallel_size": layout.cp,
        "cp_comm_type": layout.cp_comm_type if layout.cp > 1 else None,
        "zero3_mode": layout.zero3_mode if layout.zero_stage == 3 else None,
        "feasible": plan.feasible, "reason": plan.reason,
        "memory_gb": _gib(memory.total) if sized else None,
        "peak_phase": peak.phase if sized else None,
        "fullest_pipeline_rank": plan.fullest_rank if sized else None,
        "phases_gb": {p.phase: _gib(p.total) for p in memory.phases} if sized else None,
        "parts_gb": {**{name: _gib(size) for name, size in peak.parts},
                     "allocator fragmentation": _gib(peak.reserve),
                     "CUDA context": _gib(peak.context),
                     "NCCL communicators": _gib(peak.nccl)} if sized else None,
        "states_gb": _gib(memory.states.total) if sized else None,
        "activations_gb": _gib(memory.phase("train").part("activations in flight"))
        if sized else None,
        "iteration_s": _significant(time.iteration_s) if timed else None,
        "tflops_per_gpu": _significant(time.tflops_per_gpu) if timed else None,
        "bubble_fraction": _significant(time.bubble_s / time.iteration_s) if timed else None,
        "cross_node_gb_per_step": _significant(time.cross_node_bytes / 1e9)
        if timed and time.cross_node_bytes is not None else None,
        "flags": layout.flags(),
    }


def _significant(value: float) -> float:
    return float(f"{value:.6g}")


def _gib(size: int) -> float:
    return _significant(size / GIB)


def table(plans: list[Plan], top: int) -> str:
    """The first ``top`` rows of ``plans`` (all when 0), in their order."""
    rows = [_HEADER]
    for number, plan in enumerate(plans[:top or None], 1):
        layout, row = plan.layout, to_json(plan)
        bubble = "-" if row["bubble_fraction"] is None else f"{row['bubble_fraction']:.1%}"
        rows.append(
            f"{number:>4} {layout.tp:>3} {'y' if layout.sequence_parallel else '-':>2} "
            f"{layout.cp:>2} {layout.pp:>3} {layout.dp:>4} "
            f"{layout.micro_batch_size:>3} {layout.zero_stage:>4} {_MODE[layout.zero3_mode]:<9} "
            f"{layout.recompute:<9} {layout.virtual:>2} {layout.partition_method:<26} "
            f"{_cell(row['memory_gb'], 1):>6} {_cell(row['iteration_s'], 4, 'g'):>8} "
            f"{_cell(row['tflops_per_gpu'], 1):>7} {bubble:>6} "
            f"{_cell(row['cross_node_gb_per_step'], 3):>8}  {plan.reason or 'feasible'}")
    return "\n".join(rows)


def _cell(value: float | None, digits: int, style: str = "f") -> str:
    return "-" if value is None else f"{value:.{digits}{style}}"


def _kind(reason: str) -> str:
    """A reason without its details: cut before the values and fix, numbers as N."""
    head = re.split(r" \(|; |, got ", reason)[0]
    return re.sub(r"\d+(?:, (?:\d+|\.\.\.))*", "N", head)


def summary(plans: list[Plan], cluster: Cluster, model: ModelConfig, headroom: float) -> str:
    """One line on the model and cluster (and the memory a layout may use, ``headroom``
    kept free), one on how the layouts fared, and the reasons validation gave most often."""
    refused = Counter(_kind(plan.reason) for plan in plans if plan.memory is None)
    out_of_memory = sum(1 for plan in plans if plan.memory is not None and not plan.feasible)
    feasible = sum(1 for plan in plans if plan.feasible)
    lines = [f"model: {model_parameters(model):,} parameters; cluster: {cluster.nodes} nodes x "
             f"{cluster.gpus_per_node} GPUs of {cluster.gpu_memory_gb:g} GiB, "
             f"{cluster.gpu_peak_tflops:g} TFLOP/s peak; a layout may use "
             f"{cluster.gpu_memory_gb * (1 - headroom):.1f} GiB ({headroom:.0%} headroom)",
             f"{len(plans)} layouts: {feasible} feasible, {out_of_memory} out of memory, "
             f"{sum(refused.values())} refused by validation"
             + ("" if feasible else " -- no layout fits")]
    lines += [f"  {count:>6} x {reason}" for reason, count in refused.most_common(5)]
    return "\n".join(lines)
