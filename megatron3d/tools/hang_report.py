"""Say which ranks of a hung job stopped where, from the watchdog's dumps.

    python tools/hang_report.py /checkpoints/run1/hang

Reads every ``rank-XXXXX.txt`` in the directory (``--hang-dump-dir``; default ``SAVE/hang``),
prints each rank's last operation and main-thread frame, the first sequence number at which
a group's members disagree, who waits for whom, and the likely culprits by global rank and
(tp, pp, dp). Ranks that wrote no dump were frozen or dead.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from megatron3d.cli.common import OneLineParser, run_tool
from megatron3d.errors import ConfigError, DataError
from megatron3d.resilience.hang_report import analyse, format_report, load_dumps


def main(argv: Sequence[str] | None = None) -> int:
    return run_tool(_run, argv)


def _run(argv: Sequence[str] | None) -> int:
    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("dump_dir", type=Path, help="the directory holding rank-XXXXX.txt dumps")
    args = p.parse(argv)
    if not args.dump_dir.is_dir():
        raise ConfigError(f"{args.dump_dir} is not a directory: pass the job's "
                          "--hang-dump-dir (default SAVE/hang)")
    dumps, notes = load_dumps(args.dump_dir)
    if not dumps:
        raise DataError(f"no readable rank-XXXXX.txt dump in {args.dump_dir}"
                        + (f" ({'; '.join(notes)})" if notes else ""))
    sys.stdout.write(format_report(analyse(dumps), notes) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
