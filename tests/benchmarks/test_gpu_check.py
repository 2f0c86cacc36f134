"""scripts/gpu_check.sh --cpu: the GPU check's every section runs at tiny shapes on the CPU
and the report (markdown and JSON) has each of them, completed. What CI can say about a script
meant for a GPU: it runs end to end, and the report is whole."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.gpu import check, report, section, sections
from benchmarks.gpu.sections import PLANS
from tests.helpers.compile_cache import CACHE

REPO = Path(__file__).resolve().parents[2]


def test_the_cpu_mode_writes_every_section(tmp_path):
    out = tmp_path / "report"
    # the compile tests' cache: inductor's precompiled header and shared kernels built once
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1",
           "TORCHINDUCTOR_CACHE_DIR": CACHE}
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
    memory = sections["memory"]["markdown"]
    assert "| save |" in memory and "| predicted (MiB) |" in memory
    assert (out / "profile-trace.json.gz").stat().st_size > 0


def test_a_failing_section_is_recorded_with_its_traceback(tmp_path, monkeypatch):
    def broken(_ctx: object) -> None:
        raise RuntimeError("CUDA error: an illegal memory access")

    monkeypatch.setattr(importlib.import_module("benchmarks.gpu.profile"), "run", broken)
    ctx = sections.Context(cpu=True, out=tmp_path, work=tmp_path)
    found = section.run_section("profile", ctx)
    assert found["status"] == "failed" and "illegal memory access" in found["traceback"]
    results = {"profile": {**found, "seconds": 1.0},
               "memory": {"status": "ok", "markdown": "| build | 1 |", "verdict": "v",
                          "seconds": 2.0}}
    report.write(tmp_path, results, cpu=True, budget_s=60)
    text = (tmp_path / report.MARKDOWN).read_text()
    assert "RuntimeError: CUDA error: an illegal memory access" in text
    assert "\n## memory\n\n| build | 1 |" in text and "| memory | ok | v |" in text


def test_a_section_that_no_longer_fits_the_budget_is_skipped_saying_so(tmp_path):
    assert check.main(["--cpu", "--out", str(tmp_path), "--sections", "memory,environment",
                       "--budget", "1"]) == 1
    sections = json.loads((tmp_path / "report.json").read_text())["sections"]
    assert list(sections) == ["environment", "memory"]  # the planned order
    assert all(s["status"] == "skipped" for s in sections.values())
    assert "--sections memory" in sections["memory"]["traceback"]
