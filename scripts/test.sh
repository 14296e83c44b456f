#!/usr/bin/env bash
# Sets up, builds and runs every test (GPU tests skip with a message when no device is present).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh -DEMFLOW_WARNINGS_AS_ERRORS=ON "$@"
jobs=$(nproc 2>/dev/null || echo 2)
ctest --test-dir build --output-on-failure -j "$jobs"
