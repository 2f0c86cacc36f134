"""The PNG chart of step time per layout: a horizontal bar per row, one colour per
bandwidth mode, grouped by layout. Needs matplotlib (in the peer set's requirements)."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path

from benchmarks.peers.runner import RowResult
from benchmarks.peers.table import summarise_all

Mode = tuple[str, Sequence[RowResult]]  # (title, the results of every row in that mode)


def draw(modes: Sequence[Mode], warmup: int, title: str, path: Path) -> str:
    """Write the chart to ``path``; returns why it was not drawn, or ``""``."""
    if importlib.util.find_spec("matplotlib") is None:
        return "matplotlib not installed (it is in benchmarks/peers/requirements.txt)"
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a cluster node
    from matplotlib import pyplot

    rows = [r.row for r in modes[0][1]]
    labels = [f"{row.layout} {row.label}" for row in rows]
    height = 0.8 / len(modes)
    figure, axes = pyplot.subplots(figsize=(9, 0.32 * len(rows) * len(modes) + 1.5))
    for index, (mode, results) in enumerate(modes):
        summaries = summarise_all(results, warmup)
        times = [summaries[id(r)].step_ms if r.ran else 0.0 for r in results]
        offsets = [i + index * height for i in range(len(rows))]
        axes.barh(offsets, times, height=height, label=mode)
    axes.set_yticks([i + height * (len(modes) - 1) / 2 for i in range(len(rows))], labels,
                    fontsize=8)
    axes.invert_yaxis()  # the reference on top, in the order of the table
    axes.set_xlabel("median step time (ms), slowest rank; missing bar: the row did not run")
    axes.set_title(title, fontsize=9)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    pyplot.close(figure)
    return ""
