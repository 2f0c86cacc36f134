"""Turn row results into the markdown tables: one per layout, each row timed against the
megatron3d run it names as its baseline and its losses compared with the reference run."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.peers.config import REFERENCE
from benchmarks.peers.runner import RowResult

LOSS_TOLERANCE = 1e-4
"""fp32, same weights and batches, 10 steps: reordered reductions stay far below this."""
_MIB = 2**20


@dataclass(frozen=True)
class Summary:
    step_ms: float  # median over steps after warm-up of the slowest rank's step time
    peak_rss_mib: float  # the largest peak RSS of any rank
    loss_diff: float  # max over steps of |loss - reference loss|


def summarise(result: RowResult, reference: RowResult, warmup: int) -> Summary:
    if len(result.losses) != len(reference.losses):
        raise ValueError(f"{result.row.label}: {len(result.losses)} losses, the reference "
                         f"has {len(reference.losses)}")
    slowest = [max(step) for step in zip(*result.times, strict=True)]
    timed = slowest[warmup:] or slowest
    diff = max(abs(a - b) for a, b in zip(result.losses, reference.losses, strict=True))
    return Summary(1e3 * statistics.median(timed), max(result.peak_rss) / _MIB, diff)


def disagreeing(results: Sequence[RowResult], warmup: int) -> list[str]:
    """Labels of rows that ran and whose losses differ from the reference's beyond the
    tolerance."""
    reference = _reference(results)
    return [f"{r.row.label} {r.row.layout}" for r in results
            if r.ran and summarise(r, reference, warmup).loss_diff >= LOSS_TOLERANCE]


def format_tables(results: Sequence[RowResult], warmup: int) -> str:
    """Markdown: a heading and a table per layout, in the order layouts first appear."""
    reference = _reference(results)
    summaries = {id(r): summarise(r, reference, warmup) for r in results if r.ran}
    layouts = list(dict.fromkeys(r.row.layout for r in results))
    parts = []
    for layout in layouts:
        here = [r for r in results if r.row.layout == layout]
        parts.append(f"(TP, PP, DP) = {layout}\n\n" + _table(here, summaries))
    return "\n\n".join(parts)


def _reference(results: Sequence[RowResult]) -> RowResult:
    found = next((r for r in results if r.row == REFERENCE), None)
    if found is None or not found.ran:
        raise ValueError("the megatron3d single-process reference row did not run: "
                         + (found.reason if found else "it is missing"))
    return found


def _table(results: list[RowResult], summaries: dict[int, Summary]) -> str:
    lines = ["| framework | variant | step time (ms) | vs megatron3d | peak RSS per rank (MiB) "
             "| max abs loss diff |", "| --- | --- | ---: | ---: | ---: | ---: |"]
    for r in results:
        head = f"| {r.row.framework} | {r.row.variant} |"
        if not r.ran:
            lines.append(f"{head} not run: {r.reason} | | | |")
            continue
        s = summaries[id(r)]
        base = _baseline(r, results, summaries)
        ratio = "n/a" if base is None else f"{s.step_ms / base.step_ms:.2f}"
        lines.append(f"{head} {s.step_ms:.1f} | {ratio} | {s.peak_rss_mib:.0f} | "
                     f"{s.loss_diff:.1e} |")
    return "\n".join(lines)


def _baseline(result: RowResult, results: list[RowResult],
              summaries: dict[int, Summary]) -> Summary | None:
    """The megatron3d row of this layout named by ``result.row.baseline``, if it ran."""
    for r in results:
        if r.row.framework == "megatron3d" and r.row.variant == result.row.baseline and r.ran:
            return summaries[id(r)]
    return None
