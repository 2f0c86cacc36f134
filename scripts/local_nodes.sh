#!/usr/bin/env bash
# Nodes on one machine: run a launch as N nodes x K ranks, each node a network namespace with
# its own address, joined by rate-limited links (tc tbf), torchrun on every node with a c10d
# rendezvous at the first node. Needs root.
#
#   scripts/local_nodes.sh --nodes N --ranks-per-node K [--link-rate 2gbit] [--master-port P] \
#       [--slurm] -- pretrain_gpt.py ARGS...
#
# The exit code is the job's. --help says the rest (megatron3d/tools/local_nodes.py).
# Python: PYTHON if set, else the repository's .venv, else python3 on PATH.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -z "${PYTHON:-}" ]; then
  PYTHON=python3
  [ ! -x "$ROOT/.venv/bin/python" ] || PYTHON="$ROOT/.venv/bin/python"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" -m megatron3d.tools.local_nodes "$@"
