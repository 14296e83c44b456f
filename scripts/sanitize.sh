#!/usr/bin/env bash
# AddressSanitizer + UndefinedBehaviorSanitizer build of the library, the CLI and every CPU test
# suite (CUDA and benchmarks off), then ctest. Any sanitizer report aborts the test that caused
# it, so ctest fails. Build folder: build-asan (SANITIZE_BUILD to change it).
#
#   scripts/sanitize.sh               build and run every CPU test suite
#   scripts/sanitize.sh -L io         ctest arguments are passed on (here: only the io suite)
set -euo pipefail
cd "$(dirname "$0")/.."

build=${SANITIZE_BUILD:-build-asan}
jobs=${SANITIZE_JOBS:-$(nproc 2>/dev/null || echo 2)}
flags="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -g1"

start=$(date +%s)
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DEMFLOW_WITH_CUDA=OFF \
  -DEMFLOW_BUILD_BENCHMARKS=OFF -DEMFLOW_BUILD_TESTS=ON -DEMFLOW_BUILD_CLI=ON \
  -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" \
  -DCMAKE_SHARED_LINKER_FLAGS="-fsanitize=address,undefined" >/dev/null
cmake --build "$build" -j "$jobs"
built=$(date +%s)
echo "sanitize.sh: built in $((built - start)) s"

export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:strict_string_checks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
ctest --test-dir "$build" --output-on-failure -j "$jobs" "$@"
echo "sanitize.sh: tests in $(($(date +%s) - built)) s, total $(($(date +%s) - start)) s"
