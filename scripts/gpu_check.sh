#!/usr/bin/env bash
# The GPU check (issue #29): one command, about 9 minutes on one H100, a report in DIR.
#
#   bash scripts/gpu_check.sh --out DIR              # on a GPU machine
#   bash scripts/gpu_check.sh --out DIR --cpu        # tiny shapes on the CPU (CI runs this)
#   bash scripts/gpu_check.sh --out DIR --sections speed,profile   # a second try, a subset
#
# Sections: environment, cuda_tests, ranks, speed, compiled, memory, profile (README: GPU check).
# DIR gets report.md, report.json, sections.log and profile-trace.json.gz. A failing section
# is recorded with its traceback and the others still run; the exit status is 1 when any
# section did not complete. Runs with the machine's own python3 (PYTHON=... picks another):
# no virtual environment and nothing downloaded; the repository goes on PYTHONPATH.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
exec "$PYTHON" -m benchmarks.gpu.check "$@"
