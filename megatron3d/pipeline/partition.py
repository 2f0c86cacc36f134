"""Split the model's layer list into contiguous pipeline stages of balanced weight.

A pipeline runs as fast as its slowest stage, so the split minimises the heaviest stage's
weight exactly. How a layer weighs is the user's choice (``--pp-partition-method``):
``uniform`` (every layer 1), ``parameters`` (its parameter count) or ``type:REGEX`` (1 for
layers whose class name matches, else 0, as BLOOM uses ``type:transformer|embedding``).

Rules, in order of priority:

1. Stages are contiguous, non-empty and each carries weight > 0.
2. The heaviest stage is as light as possible.
3. Among those splits, stage weights are as even as possible (least sum of squares).
4. Remaining ties put the heavier stages last: the first stage holds the most in-flight
   activations under 1F1B, so it is the one to keep light.

A zero-weight layer never decides a boundary: it joins the stage of the weighted layer before
it (leading ones join the first stage). So BLOOM's embedding norm stays with the embedding and
the final norm with the last block.

``--num-layers-per-virtual-pipeline-stage N`` instead fixes the layout as Megatron does
(``fixed_layout``): N blocks per (virtual) stage, the embedding with the first blocks and the
head with the last, whatever the method.

Pure Python, no torch: the same code runs in tools and tests.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from megatron3d.errors import ConfigError

_FLAG = "--pp-partition-method"
_TYPE_PREFIX = "type:"
_METHOD_FIX = "use uniform, parameters or type:REGEX (a regex matching layer class names)"
_STAGES_FLAG = "--pipeline-model-parallel-size"
_VIRTUAL_FLAG = "--virtual-pipeline-model-parallel-size"


def layer_weights(type_names: list[str], param_counts: list[int], method: str) -> list[int]:
    """The weight of every layer under ``method`` (see the module docstring)."""
    assert len(type_names) == len(param_counts), "one parameter count per layer"
    if method == "uniform":
        return [1] * len(type_names)
    if method == "parameters":
        return list(param_counts)
    if method.startswith(_TYPE_PREFIX):
        pattern = _type_pattern(method)
        return [1 if pattern.search(name) else 0 for name in type_names]
    raise ConfigError(f"unknown pipeline partition method ({_FLAG}={method}): {_METHOD_FIX}")


def _type_pattern(method: str) -> re.Pattern[str]:
    """The compiled, case-insensitive regex of a ``type:REGEX`` method."""
    source = method[len(_TYPE_PREFIX):]
    if not source:
        raise ConfigError(f"empty regex in the partition method ({_FLAG}={method}): "
                          f"{_METHOD_FIX}")
    try:
        return re.compile(source, re.IGNORECASE)
    except re.error as err:
        raise ConfigError(f"invalid regex in the partition method ({err}) ({_FLAG}={method}): "
                          f"{_METHOD_FIX}") from None


def partition(weights: list[int], num_stages: int) -> list[int]:
    """Stage boundaries: stage ``i`` owns layers ``[bounds[i], bounds[i + 1])``.

    ``len(bounds) == num_stages + 1``, ``bounds[0] == 0``, ``bounds[-1] == len(weights)``.
    """
    assert all(w >= 0 for w in weights), "layer weights are never negative"
    weighted = [i for i, w in enumerate(weights) if w > 0]
    _check_stage_count(num_stages, len(weighted), "layers have weight > 0")
    unit_weights = [weights[i] for i in weighted]
    cuts = _even_cuts(unit_weights, num_stages, _min_bottleneck(unit_weights, num_stages))
    # Unit j (a weighted layer and the zero-weight layers after it) starts at weighted[j];
    # the first unit also takes the leading zero-weight layers.
    return [0] + [weighted[c] for c in cuts[1:-1]] + [len(weights)]


def partition_layers(type_names: list[str], param_counts: list[int], num_stages: int,
                     method: str, chunks: int = 1) -> list[int]:
    """Boundaries of the ``num_stages * chunks`` (virtual) stages of the layer list under
    ``method`` (``layer_weights`` + ``partition``): interleaving balances virtual stages."""
    weights = layer_weights(type_names, param_counts, method)
    weighted = sum(1 for w in weights if w > 0)
    _check_stage_count(num_stages, weighted, _weighted_phrase(method, len(weights)), chunks)
    return partition(weights, num_stages * chunks)


def fixed_layout(type_names: list[str], block_type: str, num_stages: int,
                 per_stage: int) -> list[int]:
    """Megatron's boundaries: each of ``num_stages`` (virtual) stages holds ``per_stage``
    layers named ``block_type``; the layers before the first block (the embedding) join the
    first stage, any other joins the block before it (so the head rides with the last)."""
    blocks = [i for i, name in enumerate(type_names) if name == block_type]
    assert len(blocks) == num_stages * per_stage, "validated: blocks = stages x per stage"
    return [0] + [blocks[s * per_stage] for s in range(1, num_stages)] + [len(type_names)]


def _weighted_phrase(method: str, num_layers: int) -> str:
    """How to say which layers count, for the too-many-stages message."""
    if method.startswith(_TYPE_PREFIX):
        return f"of {num_layers} layers match {method}"
    if method == "parameters":
        return f"of {num_layers} layers have parameters"
    return "layers"


def _check_stage_count(num_stages: int, num_weighted: int, weighted_phrase: str,
                       chunks: int = 1) -> None:
    """Every (virtual) stage needs at least one weighted layer to own."""
    if num_stages < 1:
        raise ConfigError(f"the pipeline needs at least one stage ({_STAGES_FLAG}="
                          f"{num_stages}): use a size >= 1")
    if chunks > 1 and num_stages * chunks > num_weighted:
        raise ConfigError(
            f"{num_stages} x {chunks} virtual pipeline stages but only {num_weighted} "
            f"{weighted_phrase}, so some would get no work ({_STAGES_FLAG}={num_stages}, "
            f"{_VIRTUAL_FLAG}={chunks}): lower {_VIRTUAL_FLAG} or {_STAGES_FLAG}, or change "
            f"{_FLAG}")
    if num_stages > num_weighted:
        raise ConfigError(
            f"{num_stages} pipeline stages but only {num_weighted} {weighted_phrase}, so some "
            f"stage would get no work ({_STAGES_FLAG}={num_stages}): lower "
            f"{_STAGES_FLAG} or change {_FLAG}")


def _min_bottleneck(weights: list[int], num_stages: int) -> int:
    """The least possible heaviest-stage weight (binary search over a greedy packing)."""
    low = max(max(weights), -(-sum(weights) // num_stages))
    high = sum(weights)
    while low < high:
        mid = (low + high) // 2
        if _greedy_stage_count(weights, mid) <= num_stages:
            high = mid
        else:
            low = mid + 1
    return low


def _greedy_stage_count(weights: list[int], limit: int) -> int:
    """Fewest contiguous groups with weight <= ``limit`` each (every weight <= limit)."""
    count, load = 1, 0
    for w in weights:
        if load + w > limit:
            count, load = count + 1, 0
        load += w
    return count


def _even_cuts(weights: list[int], num_stages: int, limit: int) -> list[int]:
    """Group boundaries over ``weights`` (all > 0): every group <= ``limit``, least sum of
    squares, ties broken towards a larger last group (so heavier stages come last).

    Dynamic programme over (groups, prefix length); a group's span is cut short as soon as it
    exceeds ``limit``, which keeps it near O(n^2) in practice.
    """
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    cost: list[list[int | None]] = [[None] * (n + 1) for _ in range(num_stages + 1)]
    choice = [[0] * (n + 1) for _ in range(num_stages + 1)]
    cost[0][0] = 0
    for groups in range(1, num_stages + 1):
        # Leave at least one unit for each later group.
        for end in range(groups, n - (num_stages - groups) + 1):
            best, best_start = _best_last_group(cost[groups - 1], prefix, groups, end, limit)
            cost[groups][end], choice[groups][end] = best, best_start
    assert cost[num_stages][n] is not None, "the bottleneck was feasible"
    cuts = [n]
    for groups in range(num_stages, 0, -1):
        cuts.append(choice[groups][cuts[-1]])
    return cuts[::-1]


def _best_last_group(previous: list[int | None], prefix: list[int], groups: int, end: int,
                     limit: int) -> tuple[int | None, int]:
    """Cheapest start of the group ending at ``end``; on ties the earliest start wins."""
    best: int | None = None
    best_start = 0
    for start in range(end - 1, groups - 2, -1):
        load = prefix[end] - prefix[start]
        if load > limit:
            break
        before = previous[start]
        if before is not None and (best is None or before + load * load <= best):
            best, best_start = before + load * load, start
    return best, best_start


@dataclass(frozen=True)
class TiedCopy:
    """Layer ``layer`` holds a copy of ``numel`` parameters that layer ``owner`` owns."""

    layer: int
    owner: int
    numel: int


def format_partition_table(bounds: list[int], labels: list[str], param_counts: list[int],
                           tied: list[TiedCopy] | tuple[TiedCopy, ...] = (),
                           ranks: int = 0) -> str:
    """One line per stage (parameters, layers by the labels users know), then the total.

    A tied weight counts once, in its owner's stage; a stage holding a copy of it says so.
    With ``ranks`` fewer than the stages (interleaving), a row names virtual stage k as
    pipeline rank k mod ranks, chunk k // ranks.
    """
    lines = [f"{'stage':>5}  {'parameters':>15}  layers"]
    virtual = 0 < ranks < len(bounds) - 1
    for stage, (start, end) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        mine = [c for c in tied if start <= c.layer < end]
        params = sum(param_counts[start:end]) - sum(c.numel for c in mine)
        copies = [c for c in mine if not start <= c.owner < end]  # owned by another stage
        note = (f" (+ {sum(c.numel for c in copies):,} tied copy of {labels[copies[0].owner]})"
                if copies else "")
        where = f" (rank {stage % ranks}, chunk {stage // ranks})" if virtual else ""
        lines.append(f"{stage:>5}  {params:>15,}  {_compress_labels(labels[start:end])}{note}"
                     f"{where}")
    unique = sum(param_counts) - sum(c.numel for c in tied)
    lines.append(f"{'total':>5}  {unique:>15,}  unique parameters")
    return "\n".join(lines)


def _compress_labels(labels: list[str]) -> str:
    """``[a, block 1, block 2, block 3]`` -> ``"a, blocks 1-3"``: runs of consecutively
    numbered labels are shown as one range."""
    runs: list[tuple[str, int, int]] = []  # (stem, first, last); first = -1 if unnumbered
    for label in labels:
        stem, _, number = label.rpartition(" ")
        if stem and number.isdigit():
            if runs and runs[-1][0] == stem and runs[-1][2] == int(number) - 1:
                runs[-1] = (stem, runs[-1][1], int(number))
            else:
                runs.append((stem, int(number), int(number)))
        else:
            runs.append((label, -1, -1))
    return ", ".join(label if first < 0 else f"{label} {first}" if first == last
                     else f"{label}s {first}-{last}" for label, first, last in runs)
