#!/usr/bin/env bash
# Lint and run the test suite (CPU, gloo). Extra arguments go to pytest.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
ruff check .
python -m pytest "$@"
