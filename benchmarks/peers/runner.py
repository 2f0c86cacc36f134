"""Run one row as its own torchrun and collect what its ranks wrote.

A row that cannot run (its framework is not installed, it failed, it timed out) comes back
with the reason instead of numbers, so the table always has every row.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.peers.config import Row
from benchmarks.peers.nodes import EmulatedNodes
from benchmarks.peers.worker import worker_argv

REPO = Path(__file__).resolve().parents[2]
WORKERS = {"megatron3d": "benchmarks.peers.run_megatron3d",
           "pytorch": "benchmarks.peers.run_torch",
           "megatron-core": "benchmarks.peers.run_mcore",
           "deepspeed": "benchmarks.peers.run_deepspeed"}
_RANK_PREFIX = re.compile(r"^\[(rank|default)\d+\]:")
NEEDS = {"megatron-core": "megatron.core", "deepspeed": "deepspeed"}
"""The import each peer framework's worker needs (megatron3d and torch always exist)."""


@dataclass
class RowResult:
    """A row's reports over one or more runs of it (``--repeat``), or why it has none."""

    row: Row
    losses: list[list[float]] = field(default_factory=list)  # per run, per step
    times: list[list[list[float]]] = field(default_factory=list)  # per run, rank, step (s)
    peak_rss: list[int] = field(default_factory=list)  # per rank, the largest of any run
    comm: list[dict] = field(default_factory=list)  # per rank: calls and bytes of one step
    reason: str = ""  # why there are no numbers
    cross_node: list[int | None] = field(default_factory=list)  # per rank, bytes of a step

    @property
    def ran(self) -> bool:
        return not self.reason

    def add_run(self, other: RowResult) -> RowResult:
        """This row's reports with another run's added; a failed run makes the row failed."""
        if not self.ran:
            return self
        if not other.ran:
            return other
        return RowResult(self.row, self.losses + other.losses, self.times + other.times,
                         [max(a, b) for a, b in zip(self.peak_rss, other.peak_rss, strict=True)],
                         self.comm, cross_node=self.cross_node)


def missing_package(row: Row) -> str:
    """Why ``row`` cannot start here, or ``""``."""
    module = NEEDS.get(row.framework)
    if module is None or importlib.util.find_spec(module.split(".")[0]) is not None:
        return ""
    return (f"{row.framework} not installed (pip install -r benchmarks/peers/requirements.txt "
            "into the peers venv)")


def run_row(row: Row, run_dir: Path, row_dir: Path, timeout_s: float,
            prefix: Sequence[str] = (), profile: bool = False,
            nodes: EmulatedNodes | None = None) -> RowResult:
    """Run ``row``'s torchrun (behind ``prefix``, e.g. the limited-bandwidth namespace's
    ``ip netns exec``), or its launch on emulated ``nodes``, and collect its ranks' reports;
    ``profile`` has each rank write the profiler's table of one warm-up step beside its
    report."""
    reason = missing_package(row)
    if reason:
        return RowResult(row, reason=reason)
    row_dir.mkdir(parents=True, exist_ok=True)
    (row_dir / "row.json").write_text(json.dumps(row.to_dict()))
    args = worker_argv(run_dir, row_dir, profile)
    cmd = (nodes.command(row, WORKERS[row.framework], args) if nodes is not None else
           [*prefix, sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={row.world_size}", "-m", WORKERS[row.framework], *args])
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           **(nodes.env() if nodes is not None else {})}
    log = row_dir / "log.txt"
    try:
        with log.open("w") as out:
            done = subprocess.run(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                  timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return RowResult(row, reason=f"timed out after {timeout_s:.0f} s (log: {log})")
    if done.returncode != 0:
        return RowResult(row, reason=f"{first_error(log.read_text())} (log: {log})")
    return collect(row, row_dir)


def first_error(log: str) -> str:
    """The line that names the failure: the first exception line of a traceback."""
    lines = [_RANK_PREFIX.sub("", line).strip() for line in log.splitlines() if line.strip()]
    for line in lines:
        head = line.split(":", 1)[0].split(" ")[-1]
        if head.endswith(("Error", "Exception")) and "Traceback" not in line:
            return line[:200]
    return lines[-1][:200] if lines else "failed without output"


def collect(row: Row, row_dir: Path) -> RowResult:
    reports = [json.loads((row_dir / f"rank{r}.json").read_text())
               for r in range(row.world_size)]
    losses = next((r["losses"] for r in reports if r["losses"] is not None), None)
    if losses is None:
        return RowResult(row, reason="no rank reported losses")
    return RowResult(row, losses=[losses], times=[[r["times"] for r in reports]],
                     peak_rss=[r["peak_rss"] for r in reports],
                     comm=[r["comm"] for r in reports],
                     cross_node=[r.get("cross_node_bytes") for r in reports])
