# shellcheck shell=bash
# Sourced by quickstart.sh and test.sh: create the venv under the repo once and install
# megatron3d into it. torch==2.13.0 goes first (a CPU wheel on these machines; any other
# version would download a multi-GB CUDA build).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
# shellcheck source=/dev/null
source "$VENV/bin/activate"
# Reinstall whenever setup.py changes (its hash is stamped into the venv).
STAMP="$VENV/.megatron3d-setup.sha"
WANT="$(sha256sum "$ROOT/setup.py" | cut -d' ' -f1)"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
  python -m pip install --quiet "torch==2.13.0"
  python -m pip install --quiet -e "${ROOT}[test,dev]"
  echo "$WANT" > "$STAMP"
fi
cd "$ROOT"
