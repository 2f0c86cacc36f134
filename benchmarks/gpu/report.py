"""report.md and report.json: every section, in the planned order, with its status, time
against its estimate, what it checks, and its findings or its traceback."""

from __future__ import annotations

import json
import time
from pathlib import Path

from benchmarks.gpu.sections import GPU_SHAPES_NOTE, PLANS

MARKDOWN, JSON = "report.md", "report.json"
TAIL_LINES = 40


def tail(log: Path, name: str) -> str:
    """The last lines section ``name`` wrote to the shared log."""
    text = log.read_text(errors="replace")
    own = text.rsplit(f"===== {name} =====\n", 1)[-1]
    return "\n".join(own.splitlines()[-TAIL_LINES:])


def write(out: Path, results: dict[str, dict], *, cpu: bool, budget_s: float) -> None:
    """Both files for ``results`` (section name -> what ``check`` collected)."""
    total = sum(r["seconds"] for r in results.values())
    whole = {"mode": "cpu" if cpu else "gpu", "budget_s": budget_s, "seconds": round(total, 1),
             "written": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
             "sections": {name: {**r, "checks": PLANS[name].checks,
                                 "estimate_s": PLANS[name].estimate_s}
                          for name, r in results.items()}}
    (out / JSON).write_text(json.dumps(whole, indent=1, default=str) + "\n")
    (out / MARKDOWN).write_text(markdown(whole))


def markdown(whole: dict) -> str:
    mode = ("--cpu: tiny shapes on the CPU" if whole["mode"] == "cpu"
            else "GPU; " + GPU_SHAPES_NOTE)
    lines = [f"# megatron3d GPU check ({whole['written']})", "",
             f"Mode: {mode}. Total {whole['seconds']:.0f} s of a {whole['budget_s']:.0f} s "
             "budget.", "",
             "| section | status | verdict | seconds (H100 estimate) | checks |",
             "| --- | --- | --- | --- | --- |"]
    for name, r in whole["sections"].items():
        lines.append(f"| {name} | {r['status']} | {r.get('verdict', '')} | {r['seconds']:.0f} "
                     f"({r['estimate_s']}) | {r['checks']} |")
    for name, r in whole["sections"].items():
        lines += ["", f"## {name}", ""]
        if r["status"] == "ok":
            lines.append(r["markdown"].rstrip())
            continue
        lines += [f"**{r['status']}**", "", "```", r.get("traceback", "").rstrip(), "```"]
        if r.get("log_tail"):
            lines += ["", "Its output ended with:", "", "```", r["log_tail"].rstrip(), "```"]
    return "\n".join(lines) + "\n"
