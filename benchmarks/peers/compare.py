"""``python -m benchmarks.peers.compare [--quick]``: train one GPT with megatron3d and its
peers at shared layouts, from the same weights on the same batches, and print a table per
layout (median step time, ratio to megatron3d, peak RSS per rank, collectives and bytes per
step, loss agreement) and whether each speed target was met.

Every row is its own torchrun on CPU/gloo; rows of frameworks that are not installed say so.
With ``--limited-bandwidth RATE`` every row runs a second time with its ranks talking over a
rate-limited loopback (``bandwidth.py``). With ``--emulated-nodes N [--link-rate RATE]`` only
the rows of N x K ranks run, each as N nodes of K ranks with rate-limited links between the
nodes (``nodes.py``, ``scripts/local_nodes.sh``): ZeRO-3 across nodes against FSDP2 hybrid
sharding, with the bytes megatron3d's ranks receive from other nodes per step. Exits 1 when
a row that ran disagrees with the megatron3d single-process losses.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

from benchmarks.peers import bandwidth, chart, readme
from benchmarks.peers.batches import save_batches
from benchmarks.peers.config import (
    REFERENCE,
    PeerConfig,
    Row,
    all_rows,
    build_config,
    run_order,
)
from benchmarks.peers.environment import describe
from benchmarks.peers.nodes import EmulatedNodes
from benchmarks.peers.nodes import unavailable as emulation_unavailable
from benchmarks.peers.runner import REPO, RowResult, run_row
from benchmarks.peers.table import (
    LOSS_TOLERANCE,
    cross_node_lines,
    disagreeing,
    format_tables,
)
from benchmarks.peers.targets import check_targets, node_targets

README = REPO / "benchmarks" / "README.md"
CHART = REPO / "benchmarks" / "peers_step_time.png"


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="10 steps (the loss check's length)")
    p.add_argument("--only", default="", help="run only rows whose label contains this, or "
                   "one of these comma-separated texts (the megatron3d reference always runs)")
    p.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="run every row N times, round after round, and time over all runs")
    p.add_argument("--work-dir", type=Path, default=None,
                   help="keep batches, weights, logs and rank reports here (default: a "
                   "temporary directory)")
    p.add_argument("--row-timeout", type=float, default=300.0, help="seconds per row")
    p.add_argument("--limited-bandwidth", metavar="RATE", default=None,
                   help="run every row a second time in a network namespace whose loopback "
                   "tc limits to RATE (e.g. 2gbit); needs root, else skipped with the reason")
    p.add_argument("--emulated-nodes", type=int, default=0, metavar="N",
                   help="run only the rows of N x K ranks (K >= 2), each as N nodes of K "
                   "ranks through scripts/local_nodes.sh, links between nodes limited to "
                   "--link-rate (the reference runs as a single process); needs root")
    p.add_argument("--link-rate", default="2gbit", metavar="RATE",
                   help="with --emulated-nodes: each node's link rate, tc's units")
    p.add_argument("--batch", type=int, nargs=2, metavar=("GLOBAL", "MICRO"), default=None,
                   help="global and micro-batch size instead of the config's (fewer tokens "
                   "per rank: a step bound by communication, as ZeRO-3 across nodes is)")
    p.add_argument("--seq-length", type=int, default=None, metavar="N",
                   help="tokens per sequence instead of the config's (likewise)")
    p.add_argument("--profile", action="store_true", help="every rank writes the profiler's "
                   "table of one warm-up step (profile_rank{N}.txt in its row's directory)")
    p.add_argument("--write-readme", action="store_true", help="write the report into "
                   "benchmarks/README.md and the chart into benchmarks/peers_step_time.png")
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error(f"--repeat {args.repeat}: give at least 1")
    if args.emulated_nodes < 0 or args.emulated_nodes == 1:
        p.error(f"--emulated-nodes {args.emulated_nodes}: give 2 or more nodes (0: off)")
    if args.emulated_nodes and args.write_readme:
        p.error("--write-readme writes the loopback report's section; --emulated-nodes prints "
                "its report only (benchmarks/README.md keeps it by hand)")
    if args.emulated_nodes and args.limited_bandwidth:
        p.error("--emulated-nodes limits the links between nodes (--link-rate); "
                "--limited-bandwidth limits a single loopback: give one of the two")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    with tempfile.TemporaryDirectory(prefix="peers-") as tmp:
        run_dir = args.work_dir or Path(tmp)
        run_dir.mkdir(parents=True, exist_ok=True)
        return _compare(args, run_dir, argv if argv is not None else sys.argv[1:])


def _compare(args: argparse.Namespace, run_dir: Path, argv: Sequence[str]) -> int:
    cfg = build_config(args.quick)
    if args.batch:
        cfg = dataclasses.replace(cfg, global_batch_size=args.batch[0],
                                  micro_batch_size=args.batch[1])
    if args.seq_length:
        cfg = dataclasses.replace(cfg, seq_length=args.seq_length)
    cfg.to_json(run_dir / "config.json")
    save_batches(cfg, run_dir / "batches.pt")
    wanted = args.only.split(",")
    rows = run_order([REFERENCE] + [r for r in all_rows()
                                    if r != REFERENCE and any(w in r.label for w in wanted)])
    header = describe(cfg)
    sys.stdout.write(f"{header}\n")
    if args.emulated_nodes:
        return _on_nodes(args, cfg, rows, run_dir)
    unlimited = _run_rows(args, rows, run_dir, [], "")
    if unlimited is None:
        return 1
    modes = [("unlimited loopback", unlimited)]
    notes = []
    if args.limited_bandwidth:
        title = f"loopback limited to {args.limited_bandwidth} (tc tbf, network namespace)"
        skipped = bandwidth.unavailable()
        if skipped:
            notes.append(f"### {title}: skipped, {skipped}")
        else:
            with bandwidth.limited_loopback(args.limited_bandwidth) as prefix:
                limited = _run_rows(args, rows, run_dir, prefix, "limited-")
            if limited is None:
                return 1
            modes.append((title, limited))
    report = "\n\n".join([_mode_report(m, cfg) for m in modes] + notes)
    sys.stdout.write(f"\n{report}\n")
    if args.write_readme:
        _write_readme(args, argv, cfg, header, report, modes)
    bad = [f"{label} ({title})" for title, results in modes
           for label in disagreeing(results, cfg.warmup_steps)]
    return _verdict(bad)


def _on_nodes(args: argparse.Namespace, cfg: PeerConfig, rows: list[Row], run_dir: Path) -> int:
    """The emulated-nodes mode: the reference alone, then every row that fits the nodes
    through ``scripts/local_nodes.sh``."""
    nodes = EmulatedNodes(args.emulated_nodes, args.link_rate)
    fitting = [r for r in rows if r == REFERENCE or nodes.fits(r)]
    title = nodes.title()
    skipped = emulation_unavailable() or ("" if len(fitting) > 1 else
                                          f"no row of {nodes.nodes} x K ranks, K >= 2")
    if skipped:
        sys.stdout.write(f"\n### {title}: skipped, {skipped}\n")
        return 0
    results = _run_rows(args, fitting, run_dir, [], "nodes-", nodes)
    if results is None:
        return 1
    sys.stdout.write(f"\n{_mode_report((title, results), cfg)}\n")
    bad = disagreeing(results, cfg.warmup_steps)
    return _verdict(bad)


def _mode_report(mode: tuple[str, list[RowResult]], cfg: PeerConfig) -> str:
    title, results = mode
    targets = "\n".join(check_targets(results, cfg.warmup_steps)
                        + node_targets(results, cfg.warmup_steps))
    across = "\n".join(cross_node_lines(results))
    return (f"### {title}\n\n{format_tables(results, cfg.warmup_steps)}\n\n"
            + (f"Bytes from other nodes per step (megatron3d's counter, busiest rank):\n\n"
               f"{across}\n\n" if across else "")
            + f"Targets ({title}):\n\n{targets}")


def _write_readme(args: argparse.Namespace, argv: Sequence[str], cfg: PeerConfig, header: str,
                  report: str, modes: list[tuple[str, list[RowResult]]]) -> None:
    caption = (f"{cfg.num_layers} layers, hidden {cfg.hidden_size}, seq {cfg.seq_length}, "
               f"global batch {cfg.global_batch_size}, fp32, CPU/gloo")
    why_not = chart.draw(modes, cfg.warmup_steps, f"Step time per layout: {caption}", CHART)
    picture = (f"Chart not drawn: {why_not}." if why_not else
               f"![step time per layout]({CHART.name})")
    command = " ".join(["python -m benchmarks.peers.compare", *argv])
    date = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    readme.replace_section(README, f"Written by `{command}` on {date}, {args.repeat} run(s) "
                           f"per row.\n\n```text\n{header}\n```\n\n{report}\n\n{picture}")
    sys.stdout.write(f"\nwrote the report into {README} and the chart into {CHART}\n")


def _run_rows(args: argparse.Namespace, rows: list[Row], run_dir: Path, prefix: list[str],
              tag: str, nodes: EmulatedNodes | None = None) -> list[RowResult] | None:
    """Every row, ``--repeat`` rounds of them, each round's reference first (it writes the
    weights the others start from); None if the reference failed."""
    results: list[RowResult | None] = [None] * len(rows)
    for round_ in range(args.repeat):
        for index, row in enumerate(rows):
            started = time.monotonic()
            row_dir = run_dir / f"{tag}row{index:02d}-run{round_}"
            result = run_row(row, run_dir, row_dir, args.row_timeout, prefix,
                             args.profile and round_ == 0,
                             nodes=nodes if row != REFERENCE else None)
            status = "ok" if result.ran else result.reason
            sys.stderr.write(f"[{time.monotonic() - started:5.1f} s] {tag}run {round_} "
                             f"{row.label} {row.layout}: {status}\n")
            before = results[index]
            results[index] = result if before is None else before.add_run(result)
            if row == REFERENCE and not result.ran:
                sys.stderr.write("the reference run failed: nothing to compare with\n")
                return None
    return [r for r in results if r is not None]


def _verdict(bad: list[str]) -> int:
    """Print the rows whose losses disagree with the reference; the exit code."""
    if bad:
        sys.stdout.write(f"\nloss differs by {LOSS_TOLERANCE:g} or more: {', '.join(bad)}\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

