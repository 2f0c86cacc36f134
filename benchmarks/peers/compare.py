"""``python -m benchmarks.peers.compare [--quick]``: train one GPT with megatron3d and its
peers at shared layouts, from the same weights on the same batches, and print a table per
layout (median step time, ratio to megatron3d, peak RSS per rank, loss agreement).

Every row is its own torchrun on CPU/gloo; rows of frameworks that are not installed say so.
Exits 1 when a row that ran disagrees with the megatron3d single-process losses.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.peers.batches import save_batches
from benchmarks.peers.config import REFERENCE, all_rows, build_config
from benchmarks.peers.environment import describe
from benchmarks.peers.runner import RowResult, run_row
from benchmarks.peers.table import LOSS_TOLERANCE, disagreeing, format_tables


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="10 steps (the loss check's length)")
    p.add_argument("--only", default="", help="run only rows whose label contains this "
                   "(the megatron3d reference always runs)")
    p.add_argument("--work-dir", type=Path, default=None,
                   help="keep batches, weights, logs and rank reports here (default: a "
                   "temporary directory)")
    p.add_argument("--row-timeout", type=float, default=300.0, help="seconds per row")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    with tempfile.TemporaryDirectory(prefix="peers-") as tmp:
        run_dir = args.work_dir or Path(tmp)
        run_dir.mkdir(parents=True, exist_ok=True)
        return _compare(args, run_dir)


def _compare(args: argparse.Namespace, run_dir: Path) -> int:
    cfg = build_config(args.quick)
    cfg.to_json(run_dir / "config.json")
    save_batches(cfg, run_dir / "batches.pt")
    rows = [REFERENCE] + [r for r in all_rows() if r != REFERENCE and args.only in r.label]
    results: list[RowResult] = []
    for index, row in enumerate(rows):  # the reference first: it writes weights.pt
        started = time.monotonic()
        result = run_row(row, run_dir, run_dir / f"row{index:02d}", args.row_timeout)
        status = "ok" if result.ran else result.reason
        sys.stderr.write(f"[{time.monotonic() - started:5.1f} s] {row.label} {row.layout}: "
                         f"{status}\n")
        results.append(result)
        if row == REFERENCE and not result.ran:
            sys.stderr.write("the reference run failed: nothing to compare with\n")
            return 1
    sys.stdout.write(f"{describe(cfg)}\n\n{format_tables(results, cfg.warmup_steps)}\n")
    bad = disagreeing(results, cfg.warmup_steps)
    if bad:
        sys.stdout.write(f"\nloss differs by {LOSS_TOLERANCE:g} or more: {', '.join(bad)}\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
