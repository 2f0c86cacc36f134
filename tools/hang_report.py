"""Say which ranks of a hung job stopped where, from the watchdog's dumps.

    python tools/hang_report.py /checkpoints/run1/hang

Reads every ``rank-XXXXX.txt`` in the directory (``--hang-dump-dir``; default ``SAVE/hang``),
prints each rank's last operation and main-thread frame, the first sequence number at which
a group's members disagree, who waits for whom, and the likely culprits by global rank and
(tp, pp, dp). Ranks that wrote no dump were frozen or dead.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron3d.training.hang_report import analyse, format_report, load_dumps  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dump_dir", type=Path, help="the directory holding rank-XXXXX.txt dumps")
    args = p.parse_args(argv)
    if not args.dump_dir.is_dir():
        sys.stderr.write(f"error: {args.dump_dir} is not a directory: pass the job's "
                         "--hang-dump-dir (default SAVE/hang)\n")
        return 2
    dumps, notes = load_dumps(args.dump_dir)
    if not dumps:
        sys.stderr.write(f"error: no readable rank-XXXXX.txt dump in {args.dump_dir}"
                         + (f" ({'; '.join(notes)})" if notes else "") + "\n")
        return 2
    sys.stdout.write(format_report(analyse(dumps), notes) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
