"""One section of the GPU check in this process: ``python -m benchmarks.gpu.section NAME
--out DIR --work DIR [--cpu]`` writes ``WORK/NAME.json``, its findings or its traceback.

A process per section: a CUDA error poisons the process's context, a crash or a hang ends it,
and memory peaks need a fresh allocator; the check goes on with the next section either way.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
import traceback
from pathlib import Path

from benchmarks.gpu.sections import PLANS, Context


def result_path(work: Path, name: str) -> Path:
    return work / f"{name}.json"


def run_section(name: str, ctx: Context) -> dict:
    """The section's findings as report.json holds them, or its traceback."""
    try:
        module = importlib.import_module(f"benchmarks.gpu.{name}")
        found = module.run(ctx)
    except BaseException:  # everything, even SystemExit, goes into the report
        return {"status": "failed", "traceback": traceback.format_exc()}
    return {"status": "ok", **dataclasses.asdict(found)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("name", choices=list(PLANS))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--cpu", action="store_true")
    a = p.parse_args(argv)
    ctx = Context(cpu=a.cpu, out=a.out, work=a.work / a.name)
    ctx.work.mkdir(parents=True, exist_ok=True)
    found = run_section(a.name, ctx)
    result_path(a.work, a.name).write_text(json.dumps(found, indent=1, default=str))
    return 0 if found["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
