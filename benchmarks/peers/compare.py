"""``python -m benchmarks.peers.compare [--quick]``: train one GPT with megatron3d and its
peers at shared layouts, from the same weights on the same batches, and print a table per
layout (median step time, ratio to megatron3d, peak RSS per rank, loss agreement).

Every row is its own torchrun on CPU/gloo; rows of frameworks that are not installed say so.
With ``--limited-bandwidth RATE`` every row runs a second time with its ranks talking over a
rate-limited loopback (``bandwidth.py``). Exits 1 when a row that ran disagrees with the
megatron3d single-process losses.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.peers import bandwidth
from benchmarks.peers.batches import save_batches
from benchmarks.peers.config import REFERENCE, PeerConfig, Row, all_rows, build_config
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
    p.add_argument("--limited-bandwidth", metavar="RATE", default=None,
                   help="run every row a second time in a network namespace whose loopback "
                   "tc limits to RATE (e.g. 2gbit); needs root, else skipped with the reason")
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
    sys.stdout.write(f"{describe(cfg)}\n")
    bad = _mode(args, cfg, rows, run_dir, "unlimited loopback", contextlib.nullcontext([]))
    if args.limited_bandwidth and bad is not None:
        title = f"loopback limited to {args.limited_bandwidth} (tc tbf, network namespace)"
        skipped = bandwidth.unavailable()
        if skipped:
            sys.stdout.write(f"\n## {title}: skipped, {skipped}\n")
        else:
            limited = _mode(args, cfg, rows, run_dir, title,
                            bandwidth.limited_loopback(args.limited_bandwidth))
            bad = None if limited is None else bad + limited
    if bad:
        sys.stdout.write(f"\nloss differs by {LOSS_TOLERANCE:g} or more: {', '.join(bad)}\n")
    return 0 if bad == [] else 1


def _mode(args: argparse.Namespace, cfg: PeerConfig, rows: list[Row], run_dir: Path,
          title: str, network: contextlib.AbstractContextManager[list[str]]) -> list[str] | None:
    """Run every row with the command prefix ``network`` gives and print the tables under
    ``title``; the rows whose losses disagree, or None if the reference failed."""
    with network as prefix:
        results = _run_rows(args, rows, run_dir, prefix)
    if results is None:
        return None
    sys.stdout.write(f"\n## {title}\n\n{format_tables(results, cfg.warmup_steps)}\n")
    return [f"{label} ({title})" for label in disagreeing(results, cfg.warmup_steps)]


def _run_rows(args: argparse.Namespace, rows: list[Row], run_dir: Path,
              prefix: list[str]) -> list[RowResult] | None:
    """Every row, the reference first (it writes the weights the others start from); None
    if the reference failed."""
    results: list[RowResult] = []
    for index, row in enumerate(rows):
        started = time.monotonic()
        result = run_row(row, run_dir, run_dir / f"row{index:02d}", args.row_timeout, prefix)
        status = "ok" if result.ran else result.reason
        sys.stderr.write(f"[{time.monotonic() - started:5.1f} s] {row.label} {row.layout}: "
                         f"{status}\n")
        results.append(result)
        if row == REFERENCE and not result.ran:
            sys.stderr.write("the reference run failed: nothing to compare with\n")
            return None
    return results


if __name__ == "__main__":
    sys.exit(main())
