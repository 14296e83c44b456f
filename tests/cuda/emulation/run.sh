#!/usr/bin/env bash
# Runs the CUDA backend's tests on the CPU, against the emulated runtime and cuBLAS in this folder:
# a check of the kernels' logic (indexing, masks, tiles, shared-memory barriers, shuffle masks,
# the cuBLAS argument mapping, the workspace layout, host buffers that must outlive asynchronous
# copies) on machines without a GPU. It is not a GPU: timing, the GPU's own rounding, warp
# scheduling and device memory faults outside the emulated allocations are not reproduced
# (docs/RELIABILITY.md, "What the CUDA emulation checks").
#
#   bash tests/cuda/emulation/run.sh address ['gtest filter']   # ASan + UBSan (bounds, lifetimes)
#   bash tests/cuda/emulation/run.sh thread  ['gtest filter']   # TSan: shared-memory races
#
# It configures the CMake preset emulation-<mode> (CMakePresets.json: EMFLOW_CUDA_EMULATION=ON,
# the CPU engine's host path only (EMFLOW_ONLY_CPU_PATH=host),
# the sanitizer in CMAKE_CXX_FLAGS) into build-emulation-<mode>, builds the test binary of the
# GPU suites (tests/attention, tests/cuda) and runs it in EMULATION_SHARDS processes at once
# (gtest sharding; default: one per core, at most 4), each logging to
# build-emulation-<mode>/shard-<k>.log, then prints one summary. The .cu files compile as C++
# with EMFLOW_CUDA_EMULATION defined: kernels/launch.cuh launches through emu_launch. What the
# emulation enforces is listed in cuda_runtime.h and emu_block.h. EMU_NO_DEVICE=1 makes the
# emulated runtime report no device; EMU_SEED picks the order of the blocks (default 1);
# EMU_THREADS=1 runs each CUDA thread as a host thread of its own instead of a fiber (as the
# thread mode always does: emu_block.h).
# EMULATION_JOBS sets the build's parallelism (default: every core). EMULATION_BUILD names a
# build folder configured already with EMFLOW_CUDA_EMULATION=ON and this mode's sanitizer (CI:
# scripts/sanitize.sh with SANITIZE_EMULATION=1, which builds the library once for its CPU suites
# and for this binary) to use instead of the preset's.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
MODE=${1:-address}
case "$MODE" in
  address | thread) ;;
  *) echo "mode must be 'address' or 'thread'" >&2; exit 2 ;;
esac
cores=$(nproc 2>/dev/null || echo 2)
# The default (CI runs it): every strictness check of the emulation (EmulationStrictness*) and
# the defects it exposed (FlowCuda*); the small cases of every kernel: the Small attention cases
# of the fused and unfused kernels through attend_async (float and double), three through the
# blocking attend, the generic properties on both kernels in float, the async API and workspace
# checks, the phase diagram and the flow; and the large cases (N = 200 to 4097: several key
# tiles and query blocks, key-tile skipping with a first visible key above zero, every mask): all
# of them on the fused kernel in float, and those up to N = 1000 with one head and cloud (or
# N <= 300), every mask among them, on the unfused kernel in double; the bitwise-determinism
# property (N = 1000) on the fused kernel. Left out: the unfused kernel at N = 4097 and on two
# clouds of two heads at N = 1000 (its softmax kernel runs one emulated block per row), the
# unfused float and automatic targets of the large cases (the same kernels as above), and the
# determinism property on the unfused kernel (45 s of the 122 s the rest takes on two cores).
SMALL='Small/*/cuda_fused_*:Small/*/cuda_unfused_*:Small/*/cuda_f??_B2_H2_N7_*'
SMALL+=':Properties/*/cuda_fused_f32:Properties/*/cuda_unfused_f32'
SMALL+=':CudaAsync.*:CudaWorkspace.*:CudaWithoutDevice.*:PhaseCuda*:FlowCuda*:Emulation*'
# Cross-attention, key splits and partial states: the CUDA suites' own cases and the small
# backend-generic Cross and Blocks cases.
SMALL+=':CudaCross.*:CudaKeySplits.*:CudaPartial.*:Cross/*/cuda_*_B1_H1_N?_q?_*'
SMALL+=':Cross/*/cuda_*_B2_H2_N33_*:Cross/*/cuda_*_B4_H2_N45_*'
SMALL+=':Blocks/*/cuda_f??_B1_H1_N1_*:Blocks/*/cuda_f??_B2_H2_N65_*'
# The tensor-core layer (the model of mma.sync against a plain product) and the tensor-core
# attention on bf16 and fp16 (N = 1, 17, 130, every mask, key lengths), and the factored and the
# dense layers on it through the public API (cuda::attend_factored_async, cuda::attend_async for
# 16-bit input, and the blocking forms on the device).
SMALL+=':Kinds/Mma.*:MmaLoads.*:Cases/TcAttention.*:Cases/TcFactored.*:TcFactoredRefusals.*'
SMALL+=':Cases/TcDense.*:TcDenseRefusals.*'
# Key splits on the tensor cores: split against unsplit, asked for and automatic.
SMALL+=':TcDenseSplits.*:TcFactoredSplits.*'
# The SDPA-shaped operator on the GPU (the tensor-core kernel on the caller's arrays) and its
# refusals.
SMALL+=':SdpaCuda*'
# The device decode cache: token by token against the host cache, split keys, refusals.
SMALL+=':CudaDecode.*'
# The public plan (cuda::AttentionPlan): every strategy made once and run twice against the
# one-call form and the reference, its sizes and can_implement, the refusals of a run that is not
# its plan's, the factored form in float and double, and the device binding on two emulated
# devices (their shared-memory limits, a device reset, the decode cache on its own device).
SMALL+=':CudaPlan*:Cases/CudaPlanStrategies.*'
# The device timing of `emflow bench --device cuda` and the GPU benchmarks (tools::CudaTiming),
# and the tool's GPU line itself where the build has the tool (CI's).
SMALL+=':CudaTiming.*:CudaBenchCommand.*'
# The test matrix (tests/attention/matrix_test.cpp): every CUDA entry point (blocking,
# stream-ordered, the plan, the decode cache) x form x storage x operation on its smallest
# ragged case (two clouds of 7 keys, causal, key bias and offset), run or refused as route() says.
SMALL+=':MatrixSmall/*/cuda*_B2_H2_N7_*:MatrixCoverage.*'
# Its factored rotary case (a llama layer: four heads over two kv heads, rotary positions,
# lengths, bias, offset, causal) on every CUDA entry point.
SMALL+=':MatrixRotary/*/cuda*_B2_H4_N9_*'
LARGE='Large/*/cuda_fused_f32_*'
for c in B2_H2_N200_d16_window5 B1_H1_N300_d130_window70 B3_H2_N300_d64_window1 B1_H1_N1000_d64_none \
  B1_H1_N1000_d128_causal B1_H1_N1000_d255_window300; do
  LARGE+=":Large/*/cuda_unfused_f64_${c}_*:Large/*/cuda_unfused_f64_${c}"
done
FILTER=${2:-"$SMALL:$LARGE-*RepeatedRunsAreBitwiseEqual*/cuda_unfused_*"}
jobs=${EMULATION_JOBS:-$cores}
shards=${EMULATION_SHARDS:-$((cores < 4 ? cores : 4))}

cd "$ROOT"
if [[ -n "${EMULATION_BUILD:-}" ]]; then
  BUILD=$(cd "$EMULATION_BUILD" 2>/dev/null && pwd) ||
    { echo "EMULATION_BUILD: no folder '$EMULATION_BUILD'" >&2; exit 2; }
  cache="$BUILD/CMakeCache.txt"
  sanitizer=$([[ "$MODE" == thread ]] && echo thread || echo address)
  if ! grep -qE '^EMFLOW_CUDA_EMULATION:BOOL=(ON|1|TRUE)$' "$cache" 2>/dev/null ||
    ! grep -qE "^CMAKE_CXX_FLAGS:STRING=.*-fsanitize=[a-z,]*$sanitizer" "$cache"; then
    echo "EMULATION_BUILD: $BUILD is not a build configured with EMFLOW_CUDA_EMULATION=ON and" \
      "-fsanitize=$sanitizer (its CMakeCache.txt)" >&2
    exit 2
  fi
else
  BUILD="$ROOT/build-emulation-$MODE"
  mkdir -p "$BUILD"
  cmake --preset "emulation-$MODE" >"$BUILD/configure.log" 2>&1 || { cat "$BUILD/configure.log" >&2; exit 1; }
fi
cmake --build "$BUILD" -j "$jobs" --target emflow_cuda_emulated_tests
# libgomp is not instrumented, so TSan would flag the host's OpenMP regions: one OpenMP thread.
[[ "$MODE" == thread ]] && export OMP_NUM_THREADS=1
export TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=1}

# Each shard on a core of its own when there are enough. Under TSan an emulated block is hundreds
# of host threads meeting at every barrier, and letting them migrate between cores costs more
# than the work (2 to 3 times slower, measured with two shards on two cores); under ASan a
# shard's CUDA threads are fibers of one host thread, which a core of its own serves as well.
allowed=()
if command -v taskset >/dev/null; then
  IFS=, read -r -a ranges <<<"$(taskset -cp $$ 2>/dev/null | sed 's/.*: //')"
  for r in "${ranges[@]}"; do
    [[ "$r" =~ ^([0-9]+)(-([0-9]+))?$ ]] || continue
    for ((c = BASH_REMATCH[1]; c <= ${BASH_REMATCH[3]:-${BASH_REMATCH[1]}}; ++c)); do allowed+=("$c"); done
  done
fi
pin_shards=$(( ${#allowed[@]} >= shards ? 1 : 0 ))
start=$(date +%s)
pids=()
for ((k = 0; k < shards; ++k)); do
  pin=()
  ((pin_shards)) && pin=(taskset -c "${allowed[$k]}")
  GTEST_TOTAL_SHARDS=$shards GTEST_SHARD_INDEX=$k ${pin[@]+"${pin[@]}"} \
    "$BUILD/tests/emflow_cuda_emulated_tests" --gtest_filter="$FILTER" --gtest_color=no \
    >"$BUILD/shard-$k.log" 2>&1 &
  pids+=($!)
done
failed=0
for ((k = 0; k < shards; ++k)); do
  if ! wait "${pids[$k]}"; then failed=1; fi
done
passed=0
for ((k = 0; k < shards; ++k)); do
  log="$BUILD/shard-$k.log"
  n=$(sed -n 's/^\[  PASSED  \] \([0-9]*\) tests\?\..*/\1/p' "$log" | tail -n 1)
  passed=$((passed + ${n:-0}))
  # The slowest tests of the shard and every failure, so the CI log says where time went.
  echo "== shard $k of $shards ($log)"
  grep -E '^\[ +(FAILED|SKIPPED) +\]' "$log" || true
  { grep -E '^\[       OK \]' "$log" || true; } | sed -E 's/.*\] (.*) \(([0-9]+) ms\)/\2 \1/' |
    sort -rn | awk 'NR <= 5 {printf "   %8.1f s  %s\n", $1 / 1000, $2}'
done
if ((failed)); then
  for ((k = 0; k < shards; ++k)); do
    grep -q '^\[  PASSED  \]' "$BUILD/shard-$k.log" && ! grep -q '^\[  FAILED  \]' "$BUILD/shard-$k.log" &&
      continue
    echo "== shard $k failed; the end of its log:"
    tail -n 60 "$BUILD/shard-$k.log"
  done
  echo "emulated CUDA tests FAILED after $(($(date +%s) - start)) s" >&2
  exit 1
fi
echo "emulated CUDA tests: $shards shards in $(($(date +%s) - start)) s"
# The line CI's summary reads.
echo "[  PASSED  ] $passed tests."
