"""The command line every row's worker takes (each rank parses the same one)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from benchmarks.peers.config import PeerConfig, Row


@dataclass(frozen=True)
class WorkerInputs:
    cfg: PeerConfig
    row: Row
    batches: Path  # tokens of every step (batches.py)
    weights: Path  # megatron3d's initial logical weights
    out: Path  # the row's directory: rank{N}.json go here


def worker_argv(run_dir: Path, row_dir: Path) -> list[str]:
    """The arguments of a worker for the row saved in ``row_dir`` (row.json)."""
    return ["--config", str(run_dir / "config.json"), "--batches", str(run_dir / "batches.pt"),
            "--weights", str(run_dir / "weights.pt"), "--row", str(row_dir / "row.json"),
            "--out", str(row_dir)]


def parse_worker_args(argv: list[str] | None = None) -> WorkerInputs:
    p = argparse.ArgumentParser(description=__doc__)
    for name in ("--config", "--batches", "--weights", "--row", "--out"):
        p.add_argument(name, type=Path, required=True)
    a = p.parse_args(argv)
    row = Row.from_dict(json.loads(a.row.read_text()))
    return WorkerInputs(PeerConfig.from_json(a.config), row, a.batches, a.weights, a.out)
