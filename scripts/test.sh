#!/usr/bin/env bash
# Sets up, builds and runs every test (GPU tests skip with a message when no device is present).
set -euo pipefail
cd "$(dirname "$0")/.."
# The Python environment for the Python and model-parity tests (.venv; EMFLOW_PYTHON_TORCH=0
# leaves torch out, and its tests skip).
python=$(bash scripts/setup-python.sh | tail -n 1)
bash scripts/build.sh -DEMFLOW_WARNINGS_AS_ERRORS=ON -DEMFLOW_PYTHON="$python" "$@"
jobs=$(nproc 2>/dev/null || echo 2)
ctest --test-dir build --output-on-failure -j "$jobs"
