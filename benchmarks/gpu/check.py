"""The GPU check: every section in its own process, within a time budget, into one report.

    bash scripts/gpu_check.sh --out DIR [--cpu] [--sections a,b] [--budget SECONDS]

writes ``DIR/report.md``, ``DIR/report.json``, ``DIR/sections.log`` (every section's output)
and the files sections add (the profile's trace). A section that fails, crashes or runs out
of time is recorded with its traceback (or its output's end) and the next one runs; the exit
status is 1 when any section did not complete, 0 otherwise (numbers below a target are
findings, not failures). ``--cpu`` runs the same sections at tiny shapes on the CPU (CI).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.gpu import report
from benchmarks.gpu.section import result_path
from benchmarks.gpu.sections import BUDGET_S, PLANS

MIN_START_S = 20  # a section is not started with less of the budget left
LOG = "sections.log"


def _sections(text: str | None) -> list[str]:
    if not text:
        return list(PLANS)
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in PLANS]
    if unknown:
        raise SystemExit(f"error: unknown section(s) {', '.join(unknown)}: choose from "
                         f"{', '.join(PLANS)}")
    return [n for n in PLANS if n in names]  # always in the planned order


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/gpu_check.sh", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="directory for the report")
    p.add_argument("--cpu", action="store_true", help="tiny shapes on the CPU (CI)")
    p.add_argument("--sections", help=f"comma-separated subset of: {', '.join(PLANS)}")
    p.add_argument("--budget", type=float, default=BUDGET_S,
                   help=f"seconds for the whole check (default {BUDGET_S})")
    return p.parse_args(argv)


def _environment(cpu: bool) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if cpu:
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _run_one(name: str, a: argparse.Namespace, work: Path, limit_s: float,
             log: Path) -> dict:
    """Section ``name`` in a child process, killed after ``limit_s``; its result."""
    cmd = [sys.executable, "-m", "benchmarks.gpu.section", name, "--out", str(a.out),
           "--work", str(work), *(["--cpu"] if a.cpu else [])]
    start = time.monotonic()
    with open(log, "a") as out:
        out.write(f"\n===== {name} =====\n")
        out.flush()
        child = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                 env=_environment(a.cpu), start_new_session=True)
        try:
            code: int | None = child.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            code = None
        finally:  # the section's own children (test ranks, pytest) go with it
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            child.wait()
    seconds = time.monotonic() - start
    path = result_path(work, name)
    if path.is_file():
        found = json.loads(path.read_text())
    elif code is None:
        found = {"status": "timed out", "traceback": f"killed after {limit_s:.0f} s"}
    else:
        found = {"status": "failed", "traceback": f"the section's process exited with code "
                 f"{code} without a result"}
    if found["status"] != "ok":
        found["log_tail"] = report.tail(log, name)
    return {**found, "seconds": round(seconds, 1)}


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    a.out = a.out.resolve()  # the sections' processes are told it
    names = _sections(a.sections)
    a.out.mkdir(parents=True, exist_ok=True)
    log = a.out / LOG
    log.write_text("")
    deadline = time.monotonic() + a.budget
    results: dict[str, dict] = {}
    work = Path(tempfile.mkdtemp(prefix="m3d_gpu_check_"))
    try:
        for name in names:
            left = deadline - time.monotonic()
            if left < MIN_START_S:
                results[name] = {"status": "skipped", "seconds": 0.0, "traceback":
                                 f"out of budget ({a.budget:.0f} s): run it again with "
                                 f"--sections {name}"}
                continue
            limit = min(PLANS[name].timeout_s * (2 if a.cpu else 1), left)
            sys.stderr.write(f"gpu_check: {name} (up to {limit:.0f} s)\n")
            results[name] = _run_one(name, a, work, limit, log)
            sys.stderr.write(f"gpu_check: {name} {results[name]['status']} in "
                             f"{results[name]['seconds']:.0f} s\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report.write(a.out, results, cpu=a.cpu, budget_s=a.budget)
    sys.stderr.write(f"gpu_check: report in {a.out / report.MARKDOWN}\n")
    return 0 if all(r["status"] == "ok" for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
