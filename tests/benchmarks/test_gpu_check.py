"""scripts/gpu_check.sh --cpu: the GPU check's every section runs at tiny shapes on the CPU
and the report (markdown and JSON) has each of them, completed. What CI can say about a script
meant for a GPU: it runs end to end, and the report is whole."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.gpu.sections import PLANS

REPO = Path(__file__).resolve().parents[2]


def test_the_cpu_mode_writes_every_section(tmp_path):
    out = tmp_path / "report"
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--cpu", "--out",
                           str(out)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          check=False, timeout=300)
    report = json.loads((out / "report.json").read_text())
    sections = report["sections"]
    failed = {n: s.get("traceback", "") + s.get("log_tail", "") for n, s in sections.items()
              if s["status"] != "ok"}
    assert done.returncode == 0 and not failed, (done.stderr[-2000:], failed)
    assert list(sections) == list(PLANS) and report["mode"] == "cpu"
    markdown = (out / "report.md").read_text()
    for name in PLANS:
        assert f"\n## {name}\n" in markdown
        assert sections[name]["markdown"].strip()
    assert sections["cuda_tests"]["data"]["passed"] > 0
    assert sections["cuda_tests"]["data"]["failures"] == sections["cuda_tests"]["data"][
        "errors"] == 0
    assert sections["ranks"]["data"]["all_equal"]
    assert [r["run"] for r in sections["speed"]["data"]["rows"]] == [
        "megatron3d", "PyTorch loop, eager", "PyTorch loop, torch.compile"]
    assert "| save |" in sections["memory"]["markdown"] and "n/a" in sections["memory"][
        "markdown"]
    assert (out / "profile-trace.json.gz").stat().st_size > 0
