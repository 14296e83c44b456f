#!/usr/bin/env bash
# Sets up, builds and runs every test (GPU tests skip with a message when no device is present).
set -euo pipefail
cd "$(dirname "$0")/.."
# The Python environment for the Python and model-parity tests (.venv; EMFLOW_PYTHON_TORCH=0
# leaves torch out, and its tests skip).
python=$(bash scripts/setup-python.sh | tail -n 1)
# EMFLOW_BUILD_PYTHON is given, not left to its default: a build folder configured before without
# a Python (scripts/run.sh) has it cached OFF, and the Python suite would silently be missing.
bash scripts/build.sh -DEMFLOW_WARNINGS_AS_ERRORS=ON -DEMFLOW_PYTHON="$python" \
  -DEMFLOW_BUILD_PYTHON=ON "$@"
# The Python suites must be registered (the C++ ones cannot go missing this way): a missing one
# is an error, not a smaller count that still says 100 % passed.
listed=$(ctest --test-dir build -N)
for suite in python.test_ model_parity.test_; do
  if ! grep -q "Test *#[0-9]*: $suite" <<<"$listed"; then
    echo "scripts/test.sh: no ${suite%%.*} test is registered in build/ (ctest -N shows no ${suite}*)" >&2
    exit 1
  fi
done
jobs=$(nproc 2>/dev/null || echo 2)
ctest --test-dir build --output-on-failure -j "$jobs"
