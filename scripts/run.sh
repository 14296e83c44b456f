#!/usr/bin/env bash
# Sets up, builds and runs the main job on the embedded demo cloud (GPU when present, else CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh >/dev/null
./build/emflow demo "$@"
