"""The speed targets megatron3d holds itself to against its peers, checked on a run's
results and reported met or missed with the margin, so a miss is never hidden."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.peers.runner import RowResult
from benchmarks.peers.table import ratio, summarise_all


@dataclass(frozen=True)
class Target:
    framework: str
    variant: str  # "" for every variant of the framework
    bound: float  # the peer's step time over megatron3d's must be at least this
    what: str

    def applies(self, result: RowResult) -> bool:
        return result.row.framework == self.framework and self.variant in ("",
                                                                           result.row.variant)


TARGETS = (
    Target("megatron-core", "", 1.0, "megatron3d <= Megatron-Core"),
    Target("pytorch", "FSDP2", 1.0, "ZeRO-3 <= FSDP2"),
    Target("deepspeed", "ZeRO-3", 1.0, "ZeRO-3 <= DeepSpeed ZeRO-3"),
    Target("pytorch", "DDP", 0.95, "DP within 5% of PyTorch DDP"),
    Target("pytorch", "pipelining 1F1B", 1.0, "1F1B <= torch pipelining"),
    Target("pytorch", "pipelining interleaved 1F1B", 1.0,
           "interleaved 1F1B <= torch pipelining's"),
)


def check_targets(results: Sequence[RowResult], warmup: int) -> list[str]:
    """One markdown bullet per (target, peer row): met or missed and by how much, or why it
    was not measured."""
    summaries = summarise_all(results, warmup)
    lines = []
    for target in TARGETS:
        for result in (r for r in results if target.applies(r)):
            where = f"{target.what}, {result.row.label} at {result.row.layout}"
            vs = ratio(result, results, summaries)
            if vs is None:
                reason = result.reason or "its megatron3d baseline did not run"
                lines.append(f"- not measured: {where}: {reason}")
            elif vs >= target.bound:
                lines.append(f"- met: {where}: the peer takes {vs:.2f}x our step time")
            else:
                slower = 100 * (target.bound / vs - 1)
                lines.append(f"- MISSED: {where}: the peer takes {vs:.2f}x our step time "
                             f"(megatron3d is {slower:.1f}% slower than the target allows)")
    return lines


NODE_BOUND = 0.6
"""ZeRO-3 across nodes: our best node mode's step time over our flat ZeRO-3's, at most."""


def node_targets(results: Sequence[RowResult], warmup: int) -> list[str]:
    """Where the node rows ran (``config.node_rows``): our fastest node-aware ZeRO-3 row
    against our flat ZeRO-3 (at most ``NODE_BOUND`` of its step time) and against FSDP2
    hybrid sharding (at most its step time), at their layout."""
    summaries = summarise_all(results, warmup)
    ours = [r for r in results if r.ran and r.row.framework == "megatron3d"
            and r.row.variant.startswith("ZeRO-3 ")]
    if not ours:
        return []
    best = min(ours, key=lambda r: summaries[id(r)].step_ms)
    mine = summaries[id(best)].step_ms
    lines = []
    for framework, variant, bound in (("megatron3d", "ZeRO-3", NODE_BOUND),
                                      ("pytorch", "FSDP2 hybrid", 1.0)):
        other = next((r for r in results if (r.row.framework, r.row.variant, r.row.layout)
                      == (framework, variant, best.row.layout)), None)
        where = (f"best node mode ({best.row.variant}) <= {bound:g}x {framework} {variant} "
                 f"at {best.row.layout}")
        if other is None or not other.ran:
            lines.append(f"- not measured: {where}: "
                         f"{other.reason if other is not None else 'the row did not run'}")
            continue
        share = mine / summaries[id(other)].step_ms
        verdict = "met" if share <= bound else "MISSED"
        lines.append(f"- {verdict}: {where}: ours takes {share:.2f}x its step time")
    return lines
