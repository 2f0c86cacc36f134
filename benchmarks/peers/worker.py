"""The command line every row's worker takes (each rank parses the same one)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from benchmarks.peers.config import PeerConfig, Row
from benchmarks.peers.record import StepClock


@dataclass(frozen=True)
class WorkerInputs:
    cfg: PeerConfig
    row: Row
    batches: Path  # tokens of every step (batches.py)
    weights: Path  # megatron3d's initial logical weights
    out: Path  # the row's directory: rank{N}.json go here
    profile: bool = False  # write profile_rank{N}.txt: the profiler's table of one step

    def clock(self, rank: int) -> StepClock:
        return StepClock(self.out / f"profile_rank{rank}.txt" if self.profile else None)


def worker_argv(run_dir: Path, row_dir: Path, profile: bool = False) -> list[str]:
    """The arguments of a worker for the row saved in ``row_dir`` (row.json)."""
    return ["--config", str(run_dir / "config.json"), "--batches", str(run_dir / "batches.pt"),
            "--weights", str(run_dir / "weights.pt"), "--row", str(row_dir / "row.json"),
            "--out", str(row_dir), *(["--profile"] if profile else [])]


def parse_worker_args(argv: list[str] | None = None) -> WorkerInputs:
    p = argparse.ArgumentParser(description=__doc__)
    for name in ("--config", "--batches", "--weights", "--row", "--out"):
        p.add_argument(name, type=Path, required=True)
    p.add_argument("--profile", action="store_true")
    a = p.parse_args(argv)
    row = Row.from_dict(json.loads(a.row.read_text()))
    return WorkerInputs(PeerConfig.from_json(a.config), row, a.batches, a.weights, a.out,
                        a.profile)
