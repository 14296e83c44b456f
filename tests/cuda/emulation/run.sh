#!/usr/bin/env bash
# Runs the CUDA backend's tests on the CPU, against the emulated runtime and cuBLAS in this folder:
# a check of the kernels' logic (indexing, masks, tiles, shared-memory barriers, the cuBLAS
# argument mapping, the workspace layout) on machines without a GPU. It is not a GPU: timing,
# warp scheduling and device memory faults are not reproduced. Slow (one host thread per CUDA
# thread), so keep to small cases.
#
#   bash tests/cuda/emulation/run.sh address ['gtest filter']   # ASan + UBSan (bounds, alignment)
#   bash tests/cuda/emulation/run.sh thread  ['gtest filter']   # TSan: shared-memory races
#
# The .cu files compile as C++ with EMFLOW_CUDA_EMULATION defined: kernels/launch.cuh then
# launches through emu_launch and hands out the emulated block's dynamic shared memory (poisoned
# with NaN before every block). Fresh device allocations are NaN-poisoned.
# EMU_NO_DEVICE=1 makes the emulated runtime report no device.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
HERE="$ROOT/tests/cuda/emulation"
MODE=${1:-address}
# The default: small cases of every kernel (attention, phase diagram, flow), about 5 minutes on
# 2 cores from a clean folder (CI runs it).
FILTER=${2:-'Fused*n7*:Fused*n33*:Fused*n101*:Unfused*n7*:Unfused*n33*:CudaAsync.*:CudaWorkspace.*:PhaseCuda*:FlowCuda*'}
WORK=${EMULATION_DIR:-/tmp/emflow-emulation}/$MODE
mkdir -p "$WORK/obj"
case "$MODE" in
  address) SAN=(-fsanitize=address -fsanitize=undefined -fno-sanitize-recover=undefined) ;;
  thread) SAN=(-fsanitize=thread) ;;
  *) echo "mode must be 'address' or 'thread'" >&2; exit 2 ;;
esac

FLAGS=(-std=c++20 -O1 -g "${SAN[@]}" -fno-omit-frame-pointer -pthread -DEMFLOW_WITH_CUDA=1
       -DEMFLOW_CUDA_EMULATION=1 -DEMFLOW_VERSION=\"emulation\" -I "$HERE" -I "$ROOT" -I "$ROOT/include" -I "$ROOT/src"
       -I "$ROOT/kernels" -I "$ROOT/tests")
objects=()
running=()
for s in "$ROOT"/src/core/*.cpp "$ROOT"/src/reference/*.cpp "$ROOT"/src/cpu/*.cpp \
  "$ROOT"/src/flow/*.cpp "$ROOT"/src/io/*.cpp \
  "$ROOT"/kernels/*.cpp "$ROOT"/kernels/*.cu "$ROOT"/tests/common/*.cpp "$ROOT"/tests/cuda/*.cpp; do
  [[ "$s" == */cuda_unavailable.cpp ]] && continue
  o="$WORK/obj/$(echo "$s" | tr '/' '_').o"
  objects+=("$o")
  if [[ ! -f "$o" || "$s" -nt "$o" || "$HERE/cuda_runtime.h" -nt "$o" ]]; then
    extra=()
    [[ "$s" == */src/cpu/* || "$s" == */src/flow/* ]] && extra=(-fopenmp -march=native)
    # target_clones resolvers run before TSan's runtime starts: leave those files uninstrumented.
    [[ "$MODE" == thread && "$s" =~ (sphere_kernel|observables)\.cpp$ ]] && extra+=(-fno-sanitize=thread)
    [[ "$s" == *.cu ]] && extra+=(-x c++)
    g++ "${FLAGS[@]}" "${extra[@]}" -c "$s" -o "$o" &
    running+=($!)
    if ((${#running[@]} >= 2)); then wait "${running[0]}"; running=("${running[@]:1}"); fi
  fi
done
for p in "${running[@]}"; do wait "$p"; done
g++ "${FLAGS[@]}" -fopenmp "${objects[@]}" -lgtest -lgtest_main -o "$WORK/emflow_cuda_emulated_tests"
# libgomp is not instrumented, so TSan would flag the host's OpenMP regions: one OpenMP thread.
[[ "$MODE" == thread ]] && export OMP_NUM_THREADS=1
TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=1} "$WORK/emflow_cuda_emulated_tests" --gtest_filter="$FILTER"
