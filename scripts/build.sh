#!/usr/bin/env bash
# Configures and builds emflow in ./build (extra arguments go to cmake).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
jobs=$(nproc 2>/dev/null || echo 2)
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release "$@" >build.cmake.log 2>&1 || {
  cat build.cmake.log >&2; exit 1; }
cmake --build build -j "$jobs"
