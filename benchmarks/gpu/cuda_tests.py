"""The test suite's tests marked ``cuda``, run by pytest with the tests' device switch set
(``MEGATRON3D_TEST_DEVICE``, tests/helpers/device.py): on the GPU every one of them; under
--cpu a few single-process ones on the CPU, one per kind (the rest, and the multi-rank ones
that spawn up to 8 ranks, are too slow for CI's 2 cores and run in the ordinary suite)."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from benchmarks.gpu.sections import Context, SectionResult

REPO = Path(__file__).resolve().parents[2]
_TRANSFORMERS = "tests/model/test_against_transformers.py::"
CPU_SUBSET = [f"{_TRANSFORMERS}test_logits_equal_transformers[gpt2]",
              f"{_TRANSFORMERS}test_bf16_logits_are_as_close_to_fp32_as_transformers_bf16[gpt2]",
              "tests/optim/test_mixed_precision.py",
              "tests/mpu/test_sharded_init.py::test_low_precision_weights_are_the_rounded_fp32_values"]


def selection(cpu: bool) -> list[str]:
    return ["-m", "cuda", *(CPU_SUBSET if cpu else ["tests"])]


def _counts(junit: Path) -> tuple[dict[str, int], list[str]]:
    """(tests, failures, errors, skipped) and 'name: message' of each test not passed."""
    root = ET.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    counts = {k: sum(int(s.get(k, 0)) for s in suites)
              for k in ("tests", "failures", "errors", "skipped")}
    bad = []
    for case in root.iter("testcase"):
        for kind in ("failure", "error"):
            for node in case.findall(kind):
                first = (node.get("message") or "").strip().splitlines()[:1]
                bad.append(f"{case.get('classname')}::{case.get('name')} ({kind}): "
                           f"{first[0][:300] if first else ''}")
    return counts, bad


def run(ctx: Context) -> SectionResult:
    device = ctx.device()
    junit = ctx.work / "junit.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider",
           "--continue-on-collection-errors", f"--junitxml={junit}", *selection(ctx.cpu)]
    env = {**os.environ, "MEGATRON3D_TEST_DEVICE": device.type,
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    output = (done.stdout + done.stderr).strip().splitlines()
    if not junit.is_file():
        raise RuntimeError(f"pytest wrote no report (exit {done.returncode}):\n"
                           + "\n".join(output[-40:]))
    counts, bad = _counts(junit)
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    data = {"device": str(device), "command": " ".join(cmd[1:]), "exit_code": done.returncode,
            "passed": passed, **counts, "not_passed": bad, "summary": output[-1:]}
    shown = " ".join(a for a in cmd[1:] if not a.startswith("--junitxml"))
    lines = [f"`MEGATRON3D_TEST_DEVICE={device.type} python {shown}`", "",
             f"{passed} passed, {counts['failures']} failed, {counts['errors']} errors, "
             f"{counts['skipped']} skipped (pytest exit code {done.returncode})."]
    lines += [f"- {b}" for b in bad]
    verdict = (f"{passed} passed" if not bad and done.returncode == 0
               else f"FAILED: {len(bad)} of {counts['tests']} (exit {done.returncode})")
    return SectionResult("\n".join(lines), data, verdict=verdict)
