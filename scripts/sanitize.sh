#!/usr/bin/env bash
# AddressSanitizer + UndefinedBehaviorSanitizer build of the library and the CLI (compiled as one
# unity build, EMFLOW_CLI_UNITY_BUILD), with the CPU test suites that exercise them (core,
# reference, io, cli, cpu, attention, backward, reliability; their own code without UBSan's
# pointer checks; CUDA, benchmarks and the slower flow suite are left out to keep CI short; the
# attention suite's GPU cases skip), then ctest on those suites. Any sanitizer report aborts the
# test that caused it, so ctest fails.
#
#   scripts/sanitize.sh                   build and run the suites above
#   SANITIZE_SUITES="io cli" scripts/sanitize.sh
#   SANITIZE_SHARDS=0 scripts/sanitize.sh -R Npy   one ctest test per case; ctest arguments
#                                                  after the options are passed on
#
#   SANITIZE_EMULATION=1 scripts/sanitize.sh     the same suites on a library built against the
#                                                CPU emulation of CUDA (EMFLOW_CUDA_EMULATION),
#                                                which reports no device to them (EMU_NO_DEVICE=1),
#                                                and the emulation's GPU test binary built beside
#                                                them: tests/cuda/emulation/run.sh then runs it
#                                                from this build (EMULATION_BUILD), so that CI
#                                                compiles the library once for both
#
# Environment: SANITIZE_BUILD (build folder, default build-asan), SANITIZE_SUITES, SANITIZE_JOBS,
# SANITIZE_SHARDS (gtest shards per suite, default 6), SANITIZE_EMULATION (0 or 1, default 0).
set -euo pipefail
cd "$(dirname "$0")/.."

build=${SANITIZE_BUILD:-build-asan}
mkdir -p "$build" && build=$(cd "$build" && pwd)  # absolute from here on
jobs=${SANITIZE_JOBS:-$(nproc 2>/dev/null || echo 2)}
# Each suite runs as this many gtest shards (processes): starting an instrumented binary costs
# more than most tests, so one process per test would spend most of the run starting up.
# SANITIZE_SHARDS=0 gives one ctest test per gtest case (names each failure in the summary).
shards=${SANITIZE_SHARDS:-6}
read -r -a suites <<<"${SANITIZE_SUITES:-core reference io cli cpu attention backward reliability}"
flags="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -g1"

emulation=${SANITIZE_EMULATION:-0}
[[ "$emulation" == 0 || "$emulation" == 1 ]] ||
  { echo "sanitize.sh: SANITIZE_EMULATION must be 0 or 1, not '$emulation'" >&2; exit 2; }

start=$(date +%s)
# -O1: a third of the compile time of -O3 and fast enough for the tests; asserts stay on.
# One path of the CPU engine, the one this processor takes (EMFLOW_ONLY_CPU_PATH=host): the
# suites run that path alone here, and it is a third of src/cpu's compile time.
# The test code (EMFLOW_TEST_CXX_FLAGS) goes without UBSan's pointer checks, most of UBSan's
# compile time; ASan and UBSan's other checks still run in it, the library and the tool get every
# check (docs/RELIABILITY.md section 2: the measurements, and what that gives up).
# The same flags as the emulation's preset (CMakePresets.json, emulation-address).
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS_RELEASE=-O1 \
  -DEMFLOW_TEST_CXX_FLAGS="-fno-sanitize=alignment,null,vptr,pointer-overflow,object-size" \
  -DEMFLOW_ONLY_CPU_PATH=host -DEMFLOW_WITH_CUDA=OFF -DEMFLOW_BUILD_BENCHMARKS=OFF -DEMFLOW_BUILD_TESTS=ON \
  -DEMFLOW_BUILD_CLI=ON -DEMFLOW_CLI_UNITY_BUILD=ON -DCMAKE_CXX_FLAGS="$flags" -DEMFLOW_TEST_SHARDS="$shards" \
  -DEMFLOW_CUDA_EMULATION="$( ((emulation)) && echo ON || echo OFF)" \
  -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" >/dev/null
targets=(emflow_cli)
for suite in "${suites[@]}"; do targets+=("emflow_${suite}_tests"); done
if ((emulation)); then
  targets+=(emflow_cuda_emulated_tests)
  # The CPU suites see a build with CUDA and no device, as on a machine without a GPU.
  export EMU_NO_DEVICE=1
fi
cmake --build "$build" --target "${targets[@]}" -j "$jobs"
built=$(date +%s)
echo "sanitize.sh: built in $((built - start)) s"

# fontconfig (reached through cairo when the CLI draws text) keeps its configuration cache for
# the life of the process on purpose; that is not a leak of emflow's.
cat >"$build/lsan.supp" <<'SUPPRESSIONS'
leak:libfontconfig.so
SUPPRESSIONS
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:strict_string_checks=1}
# print_suppressions=0: the list of suppressions used would land on the stderr that the CLI
# tests read.
export LSAN_OPTIONS=${LSAN_OPTIONS:-suppressions=$build/lsan.supp:print_suppressions=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
labels="^($(IFS='|'; echo "${suites[*]}"))\$"
ctest --test-dir "$build" --output-on-failure -j "$jobs" -L "$labels" "$@"
if [[ "$shards" -gt 0 ]]; then
  # gtest's own summaries, summed over the shards (skipped: the GPU cases of the attention suite).
  log="$build/Testing/Temporary/LastTest.log"
  cases=$(sed -n 's/^\[  PASSED  \] \([0-9]*\) tests\?\./\1/p' "$log" | awk '{ n += $1 } END { print n + 0 }')
  skips=$(sed -n 's/^\[  SKIPPED \] \([0-9]*\) tests\?, listed below:/\1/p' "$log" |
    awk '{ n += $1 } END { print n + 0 }')
  echo "sanitize.sh: $cases test cases passed, $skips skipped (in $shards shards per suite)"
fi
echo "sanitize.sh: tests in $(($(date +%s) - built)) s, total $(($(date +%s) - start)) s"
