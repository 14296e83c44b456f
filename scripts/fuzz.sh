#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/, clang + AddressSanitizer + UndefinedBehaviorSanitizer)
# and runs each for a bounded time from its seed corpus in tests/fuzz_corpus/<target>/.
# Fails on any crash, leak, timeout, out-of-memory or sanitizer report; the input that caused it
# is saved under the build folder's artifacts/ (rerun it with: build-fuzz/fuzz/<target> <file>).
#
#   scripts/fuzz.sh                   every target, FUZZ_SECONDS (default 45) seconds each
#   FUZZ_SECONDS=600 scripts/fuzz.sh fuzz_npy
#
# Environment: FUZZ_SECONDS, FUZZ_BUILD (build folder, default build-fuzz), CXX_CLANG (default
# clang++-14 if present, else clang++), FUZZ_JOBS (parallel build jobs, default 2).
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=${FUZZ_SECONDS:-45}
build=${FUZZ_BUILD:-build-fuzz}
mkdir -p "$build" && build=$(cd "$build" && pwd)  # absolute from here on
jobs=${FUZZ_JOBS:-2}
if [[ -z "${CXX_CLANG:-}" ]]; then
  if command -v clang++-14 >/dev/null; then CXX_CLANG=clang++-14; else CXX_CLANG=clang++; fi
fi
if ! command -v "$CXX_CLANG" >/dev/null; then
  echo "fuzz.sh: $CXX_CLANG not found; install clang-14 and libclang-rt-14-dev (libFuzzer)" >&2
  exit 2
fi
targets=("$@")
if [[ ${#targets[@]} -eq 0 ]]; then
  targets=(fuzz_npy fuzz_safetensors fuzz_gguf fuzz_attend_cli)
fi

start=$(date +%s)
# The CPU engine's path this processor takes only (EMFLOW_ONLY_CPU_PATH=host): the one a
# fuzzer runs here.
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER="$CXX_CLANG" \
  -DEMFLOW_ONLY_CPU_PATH=host -DEMFLOW_BUILD_FUZZERS=ON -DEMFLOW_WITH_CUDA=OFF -DEMFLOW_BUILD_TESTS=OFF \
  -DEMFLOW_BUILD_BENCHMARKS=OFF -DEMFLOW_BUILD_CLI=OFF >/dev/null
cmake --build "$build" --target "${targets[@]}" -j "$jobs"
echo "fuzz.sh: built in $(($(date +%s) - start)) s"

export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:allocator_may_return_null=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
artifacts="$build/artifacts"
mkdir -p "$artifacts"
# The targets run side by side (each is single-threaded), so the wall time is about
# FUZZ_SECONDS whatever their number on a machine with as many cores.
pids=()
for target in "${targets[@]}"; do
  seeds="$PWD/tests/fuzz_corpus/$target"
  corpus="$build/corpus/$target"  # seeds plus what this run discovers; kept between runs
  mkdir -p "$corpus"
  dict=()
  if [[ -f "fuzz/$target.dict" ]]; then dict=(-dict="$PWD/fuzz/$target.dict"); fi
  echo "fuzz.sh: $target for $seconds s (seeds: $(ls "$seeds" | wc -l) files)"
  "$build/fuzz/$target" "$corpus" "$seeds" "${dict[@]}" -max_total_time="$seconds" \
    -timeout=10 -rss_limit_mb=2048 -max_len=4096 -print_final_stats=1 \
    -artifact_prefix="$artifacts/$target-" >"$build/$target.log" 2>&1 &
  pids+=($!)
done
status=0
for i in "${!targets[@]}"; do
  target=${targets[$i]}
  log="$build/$target.log"
  result=0
  wait "${pids[$i]}" || result=$?
  # The targets' scratch files and folders carry their process id (libFuzzer ends with _Exit,
  # so they cannot remove them themselves); libomp leaves a registration file per process.
  for scratch in /dev/shm /tmp; do
    rm -rf "$scratch/emflow_fuzz_cli_${pids[$i]}" "$scratch/emflow_fuzz_npy_${pids[$i]}_"* \
      "$scratch/emflow_fuzz_safetensors_${pids[$i]}_"* \
      "$scratch/emflow_fuzz_gguf_${pids[$i]}_"* \
      "$scratch/__KMP_REGISTERED_LIB_${pids[$i]}"*
  done
  if [[ $result -eq 0 ]]; then
    grep -E "stat::number_of_executed_units|stat::new_units_added|stat::peak_rss_mb" "$log" |
      sed "s/^/fuzz.sh: $target: /"
    echo "fuzz.sh: $target: corpus $(ls "$build/corpus/$target" | wc -l) files; passed"
  else
    status=1
    echo "fuzz.sh: $target FAILED; the last lines of $log:"
    tail -n 60 "$log"
  fi
done
echo "fuzz.sh: total $(($(date +%s) - start)) s"
exit $status
