#!/usr/bin/env bash
# Device check of the CUDA backend: one call, under 9 minutes, on a machine with an NVIDIA GPU.
#
#   bash scripts/device-check.sh             # on the GPU machine, from the repository root
#   bash scripts/device-check.sh --prepare   # on a build machine without a GPU (see below)
#
# It builds the GPU tests and benchmarks for sm_90 (Release, -j16), runs the GPU tests, runs
# compute-sanitizer memcheck, racecheck, synccheck and initcheck over the whole GPU suite (the
# four at once), runs the GPU benchmarks briefly, and prints a short table last. Expected on an
# H200: build 2 to 3 minutes, tests 1, sanitizers at most 3.5, benchmarks 2 to 3 (with the torch
# peers): under 9 in all, later steps skipped past 6.5 minutes (BUDGET_S). Everything is also
# written to $OUT/device-check.log when OUT is set (else to ./device-check.log), with the date,
# the GPU and the commit at the top, ready to be committed under bench/results/ (see
# bench/results/README.md).
#
# The build needs CMake, a CUDA toolkit, OpenMP, GoogleTest and Google Benchmark on the GPU
# machine (DEPS_PREFIX=/path adds a prefix where they are installed). Where they are missing, run
# `--prepare` on a machine that has them: it builds the same binaries for sm_90 into
# build-device-prebuilt/ (bin/, lib/ with the Google Benchmark shared library, COMMIT); carry that
# folder to the GPU machine and the check uses it when its own build is not possible.
#
# Environment: JOBS (16), BUILD (build-device), PREBUILT (build-device-prebuilt),
# BENCH_MIN_TIME (0.05 seconds per benchmark), BENCH_FILTER (all), DEPS_PREFIX (none),
# SANITIZER_LIMIT (210 seconds for each compute-sanitizer tool). Nsight Compute (ncu) profiles
# the tensor-core kernel last, where it is installed and time is left.
set -uo pipefail
cd "$(dirname "$0")/.."

JOBS=${JOBS:-16}
BUILD=${BUILD:-build-device}
PREBUILT=${PREBUILT:-build-device-prebuilt}
BENCH_MIN_TIME=${BENCH_MIN_TIME:-0.05}
BENCH_FILTER=${BENCH_FILTER:-.}
BUDGET_S=390  # later steps are skipped once this much time has gone, to stay under 9 minutes

configure_and_build() {  # $1: build folder
  local prefix=()
  [[ -n "${DEPS_PREFIX:-}" ]] && prefix=(-DCMAKE_PREFIX_PATH="$DEPS_PREFIX")
  local generator=()
  command -v ninja >/dev/null 2>&1 && generator=(-G Ninja)
  cmake -S . -B "$1" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DEMFLOW_WITH_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DEMFLOW_BUILD_CLI=OFF -DEMFLOW_BUILD_TESTS=ON \
    -DEMFLOW_BUILD_BENCHMARKS=ON "${prefix[@]}" &&
    cmake --build "$1" --target emflow_attention_tests emflow_cuda_tests emflow_bench_cuda \
      -j "$JOBS"
}

if [[ "${1:-}" == "--prepare" ]]; then
  set -e
  configure_and_build "$PREBUILT/build"
  mkdir -p "$PREBUILT/bin" "$PREBUILT/lib"
  cp "$PREBUILT/build/tests/emflow_attention_tests" "$PREBUILT/build/tests/emflow_cuda_tests" \
    "$PREBUILT/build/bench/emflow_bench_cuda" "$PREBUILT/bin/"
  # Google Benchmark is a shared library on Debian; GoogleTest is linked statically.
  ldd "$PREBUILT/bin/emflow_bench_cuda" | awk '/libbenchmark/ {print $3}' |
    xargs -r -I{} cp -L {} "$PREBUILT/lib/"
  git rev-parse --short HEAD >"$PREBUILT/COMMIT" 2>/dev/null || echo unknown >"$PREBUILT/COMMIT"
  rm -rf "$PREBUILT/build"
  echo "prepared $PREBUILT ($(du -sh "$PREBUILT" | cut -f1)); carry it to the GPU machine"
  exit 0
fi

LOG_DIR=${OUT:-.}
mkdir -p "$LOG_DIR"
LOG="$LOG_DIR/device-check.log"
exec > >(tee "$LOG") 2>&1

START=$(date +%s)
elapsed() { echo $(($(date +%s) - START)); }
declare -a TABLE
# The tensor-core tests' "[margin]" lines (tests/cuda/tc_reference.hpp): each case's error against
# the naive implementation's, summarised after the table.
MARGINS="$LOG_DIR/device-check-margins.txt"
: >"$MARGINS"
record() { TABLE+=("$(printf '%-22s %-44s %6ss' "$1" "$2" "$3")"); }
over_budget() { (($(elapsed) > BUDGET_S)); }

COMMIT=$(git rev-parse --short HEAD 2>/dev/null || cat "$PREBUILT/COMMIT" 2>/dev/null || echo unknown)
echo "# emflow device check"
echo "date:   $(date -u '+%Y-%m-%d %H:%M UTC')"
echo "gpu:    $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo 'nvidia-smi unavailable')"
echo "commit: $COMMIT"
echo "nvcc:   $(nvcc --version 2>/dev/null | tail -1 || echo 'not found')"
echo

# 1. Build (or fall back to carried binaries).
step_start=$(elapsed)
# The attention suite (every backend; its GPU cases and the async API's tests) and the CUDA
# suite (the plan, cuBLAS loading, NaN rule, flow and phase on the device).
ATTENTION="$BUILD/tests/emflow_attention_tests"
TESTS="$BUILD/tests/emflow_cuda_tests"
BENCH="$BUILD/bench/emflow_bench_cuda"
echo "== build for sm_90 in $BUILD"
export -f configure_and_build
export JOBS DEPS_PREFIX
# shellcheck disable=SC2016  # $0 is expanded by the inner shell
if timeout 300 bash -c 'configure_and_build "$0"' "$BUILD"; then
  record "build (sm_90)" "ok" $(($(elapsed) - step_start))
elif [[ -x "$PREBUILT/bin/emflow_cuda_tests" ]]; then
  ATTENTION="$PREBUILT/bin/emflow_attention_tests"
  TESTS="$PREBUILT/bin/emflow_cuda_tests"
  BENCH="$PREBUILT/bin/emflow_bench_cuda"
  export LD_LIBRARY_PATH="$PWD/$PREBUILT/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  echo "build failed here; using the carried binaries in $PREBUILT (commit $(cat "$PREBUILT/COMMIT"))"
  record "build (sm_90)" "failed; using $PREBUILT" $(($(elapsed) - step_start))
else
  record "build (sm_90)" "FAILED (see log; try --prepare)" $(($(elapsed) - step_start))
fi

run_step() {  # $1 name, $2 timeout seconds, rest: command
  local name=$1 limit=$2
  shift 2
  if over_budget; then
    record "$name" "skipped (time budget)" 0
    return
  fi
  if [[ ! -x "$TESTS" || ! -x "$ATTENTION" ]]; then
    record "$name" "skipped (no binary)" 0
    return
  fi
  echo
  echo "== $name: $*"
  local t0 status summary
  t0=$(elapsed)
  timeout "$limit" "$@" 2>&1 | tee "$LOG_DIR/.step.out"
  status=${PIPESTATUS[0]}
  grep -E '^\[margin\] ' "$LOG_DIR/.step.out" >>"$MARGINS" || true
  summary=$(grep -E '^\[ +(PASSED|FAILED|SKIPPED) +\] [0-9]+ test' "$LOG_DIR/.step.out" |
    sed -E 's/^\[ *([A-Z]+) *\] ([0-9]+) tests?.*/\2 \1/' | tr '\n' ' ' | tr '[:upper:]' '[:lower:]')
  grep -q "ERROR SUMMARY" "$LOG_DIR/.step.out" &&
    summary="$summary$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$LOG_DIR/.step.out" | tail -1 |
      sed -E 's/.*SUMMARY: /; /')"
  if ((status == 0)); then
    record "$name" "ok ${summary}" $(($(elapsed) - t0))
  elif ((status == 124)); then
    record "$name" "TIMED OUT after ${limit}s ${summary}" $(($(elapsed) - t0))
  else
    record "$name" "FAILED (exit $status) ${summary}" $(($(elapsed) - t0))
  fi
}

# 2. The GPU tests (the CPU reference they compare with runs on the host). First the MMA layer
#    of the tensor-core kernels (tests/cuda/mma_test.cpp): one instruction of each kind against
#    a plain product, and its shared-memory loads (ldmatrix, .trans and the fragment loads built
#    on them; cp.async with every zero-fill length) register by register against the PTX ISA's
#    layout, so a layout that differs from the hardware's shows in a minute.
run_step "gpu tests: mma layer" 60 "$TESTS" --gtest_filter='Kinds/Mma.*:MmaLoads.*' --gtest_color=no
GPU_ATTENTION='*/cuda_*:CudaAsync.*:CudaWorkspace.*:CudaWithoutDevice.*'
run_step "gpu tests: attention" 240 "$ATTENTION" --gtest_filter="$GPU_ATTENTION" --gtest_color=no
run_step "gpu tests: cuda suite" 180 "$TESTS" --gtest_color=no

# 3. compute-sanitizer over the whole GPU suite (both attention algorithms, every tile width,
#    the Large cases up to N = 4097, masks, heads, the phase kernel, the flow's kernels): memcheck
#    (out-of-bounds and misaligned device accesses, bad frees), racecheck (shared-memory hazards),
#    synccheck (barriers and shuffles reached by part of a block or warp) and initcheck (reads of
#    device memory never written). The four tools run at once, each over both binaries in turn
#    (the host's reference computations use the CPU cores, the GPU is shared), so the step takes
#    as long as the slowest tool, at most SANITIZER_LIMIT seconds.
SANITIZER=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
SANITIZER_LIMIT=${SANITIZER_LIMIT:-210}
sanitize_suite() {  # $1 tool; writes $LOG_DIR/sanitizer-$1.log; 0 when both pass, 124 on time
  local tool=$1 extra=() status=0 one=0 t0=$SECONDS left
  [[ "$tool" == racecheck ]] && extra=(--racecheck-report hazard)
  {
    timeout "$SANITIZER_LIMIT" "$SANITIZER" --tool "$tool" "${extra[@]}" --error-exitcode 1 \
      "$ATTENTION" --gtest_filter="$GPU_ATTENTION" --gtest_color=no || status=$?
    left=$((SANITIZER_LIMIT - (SECONDS - t0)))
    ((left < 1)) && left=1
    timeout "$left" "$SANITIZER" --tool "$tool" "${extra[@]}" --error-exitcode 1 "$TESTS" \
      --gtest_color=no || one=$?
    ((status == 0)) && status=$one
  } >"$LOG_DIR/sanitizer-$tool.log" 2>&1
  return $status
}
if over_budget || [[ ! -x "$TESTS" || ! -x "$ATTENTION" ]]; then
  record "compute-sanitizer" "skipped (time budget or no binary)" 0
else
  echo
  echo "== compute-sanitizer memcheck, racecheck, synccheck, initcheck (at once, ${SANITIZER_LIMIT} s each at most)"
  t0=$(elapsed)
  declare -A SANITIZER_PID
  for tool in memcheck racecheck synccheck initcheck; do
    sanitize_suite "$tool" &
    SANITIZER_PID[$tool]=$!
  done
  for tool in memcheck racecheck synccheck initcheck; do
    wait "${SANITIZER_PID[$tool]}"
    status=$?
    log="$LOG_DIR/sanitizer-$tool.log"
    summary=$(grep -E '^\[ +(PASSED|FAILED) +\] [0-9]+ test' "$log" 2>/dev/null |
      sed -E 's/^\[ *([A-Z]+) *\] ([0-9]+) tests?.*/\2 \1/' | tr '\n' ' ' | tr '[:upper:]' '[:lower:]')
    summary="$summary$(grep -E '(ERROR|RACECHECK) SUMMARY' "$log" 2>/dev/null | sed -E 's/.*SUMMARY: /; /' |
      tr '\n' ' ')"
    echo "-- $tool (exit $status): $summary"
    grep -E '^=========' "$log" 2>/dev/null | grep -vE 'SUMMARY|COMPUTE-SANITIZER' | head -n 20
    if ((status == 0)); then
      record "$tool: gpu suite" "ok ${summary}" $(($(elapsed) - t0))
    elif ((status == 124)); then
      record "$tool: gpu suite" "TIMED OUT after ${SANITIZER_LIMIT}s ${summary}" $(($(elapsed) - t0))
    else
      record "$tool: gpu suite" "FAILED (exit $status) ${summary}" $(($(elapsed) - t0))
    fi
  done
fi

# 4. Benchmarks, briefly: emflow's kernels and, where cuDNN 9 was found at build time,
#    BM_CudnnSdpa (cuDNN's fused flash attention in bf16 on the same shapes; bench/cuda_cudnn.cpp),
#    whose ratio to emflow's fused kernel the summary prints per shape, beside emflow's own
#    tensor-core path (BM_TensorCore, bf16 and tf32 on cuDNN's shapes; bench/cuda_tensor_core.cpp)
#    and its bf16 / cuDNN ratio; and the SDPA operator's backward (BM_SdpaBackward,
#    bench/cuda_sdpa_backward.cpp: bf16 on the tensor cores, deterministic and with dQ by atomics,
#    and the float32 kernels; with the float forward, BM_SdpaForward: the float32 kernel and TF32
#    on the tensor cores), in a step of its own, then its peers cuDNN and FlashAttention-2
#    through PyTorch (bench/torch_cuda_sdpa.py, forward and backward, where python3 has torch).
#    The peer runs as a step of its own (12 shapes, each building its cuDNN plan once, which can
#    take seconds) so that it cannot push emflow's benchmarks past their time limit.
BENCH_JSON="$LOG_DIR/device-check-bench.json"
CUDNN_JSON="$LOG_DIR/device-check-cudnn.json"
OWN_FILTER=$BENCH_FILTER
TC_JSON="$LOG_DIR/device-check-tensor-core.json"
BACKWARD_JSON="$LOG_DIR/device-check-sdpa-backward.json"
TORCH_JSON="$LOG_DIR/device-check-torch-sdpa.json"
[[ "$OWN_FILTER" == "." ]] && OWN_FILTER='-BM_CudnnSdpa|BM_TensorCore|BM_SdpaBackward|BM_SdpaForward'
run_step "benchmarks" 90 "$BENCH" --benchmark_min_time="$BENCH_MIN_TIME" \
  --benchmark_filter="$OWN_FILTER" --benchmark_out="$BENCH_JSON" --benchmark_out_format=json
if [[ "$BENCH_FILTER" == "." ]]; then
  run_step "benchmarks: tensor cores" 60 "$BENCH" --benchmark_min_time="$BENCH_MIN_TIME" \
    --benchmark_filter=BM_TensorCore --benchmark_out="$TC_JSON" --benchmark_out_format=json
  run_step "benchmarks: cuDNN bf16" 60 "$BENCH" --benchmark_min_time="$BENCH_MIN_TIME" \
    --benchmark_filter=BM_CudnnSdpa --benchmark_out="$CUDNN_JSON" --benchmark_out_format=json
  run_step "benchmarks: SDPA backward" 90 "$BENCH" --benchmark_min_time="$BENCH_MIN_TIME" \
    --benchmark_filter='BM_SdpaBackward|BM_SdpaForward' --benchmark_out="$BACKWARD_JSON" \
    --benchmark_out_format=json
  # The peers of the backward (and of the forward): cuDNN's fused SDPA and FlashAttention-2 as
  # PyTorch dispatches them, on the same shapes, each checked against torch's float32 math first.
  if python3 -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' \
    >/dev/null 2>&1; then
    run_step "benchmarks: torch cuDNN, FA2" 120 python3 bench/torch_cuda_sdpa.py --out "$TORCH_JSON"
  else
    record "benchmarks: torch cuDNN, FA2" "skipped (python3 has no torch with CUDA)" 0
  fi
fi
# 5. Nsight Compute on the tensor-core attention kernel, where ncu is installed and time is left:
#    bf16 at d = 64 and 128 and TF32 at d = 128 (N = 4096, not causal), one launch each: its
#    throughput against the peaks, occupancy (registers, shared memory, blocks per SM), the
#    tensor pipe's use, shared-memory bank conflicts of loads and stores, and the warps' stall
#    reasons, to hold against the predictions in kernels/tc_attention.cu and docs/PERF.md.
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
if [[ ! -x "$NCU" ]]; then
  record "nsight compute" "skipped (ncu not installed)" 0
elif [[ ! -x "$BENCH" ]] || over_budget; then
  record "nsight compute" "skipped (time budget or no binary)" 0
else
  for shape in "d:64/causal:0/tf32:0 bf16 d=64" "d:128/causal:0/tf32:0 bf16 d=128" \
    "d:128/causal:0/tf32:1 tf32 d=128"; do
    filter=${shape%% *}
    run_step "ncu: ${shape#* }" 60 "$NCU" --kernel-name regex:tc_attention_kernel \
      --launch-count 1 --section SpeedOfLight --section Occupancy --section LaunchStats \
      --section WarpStateStats --metrics "$(printf '%s,' \
      sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active \
      l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum \
      l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum \
      smsp__inst_executed_op_ldsm.sum | sed 's/,$//')" \
      "$BENCH" --benchmark_filter="BM_TensorCore/N:4096/$filter" --benchmark_min_time=0.01
  done
fi
rm -f "$LOG_DIR/.step.out"

# 6. The table, last.
echo
echo "== device check summary ($(elapsed) s in all; commit $COMMIT)"
printf '%s\n' "${TABLE[@]}"
if [[ -s "$MARGINS" ]]; then
  # Per suite and quantity: cases, the largest error / naive error (the rule allows 2), and the
  # worst case's name.
  echo
  echo "accuracy rule on the hardware: error / naive error per tensor-core suite (the rule allows 2)"
  awk '{ key = $2 " " $4; n[key]++
         if (!(key in worst) || $10 > worst[key]) { worst[key] = $10; name[key] = $3 } }
       END { for (k in n) printf "  %-44s %4d cases  worst %6.3f  (%s)\n", k, n[k], worst[k], name[k] }' \
    "$MARGINS" | sort
fi
if [[ -s "$BENCH_JSON" ]] && command -v python3 >/dev/null 2>&1; then
  echo
  python3 - "$BENCH_JSON" "$CUDNN_JSON" "$TC_JSON" "$BACKWARD_JSON" "$TORCH_JSON" <<'EOF'
import json, os, sys
runs = []
for path in sys.argv[1:]:
    if os.path.exists(path) and os.path.getsize(path) > 0:
        runs += json.load(open(path))["benchmarks"]
rows, flow = {}, []
for b in runs:
    if b.get("run_type") == "aggregate" or "error_message" in b:
        continue
    kind, _, args = b["name"].partition("/")
    if kind in ("BM_PhaseDefault", "BM_FlowRk4"):
        flow.append((b["name"], b["real_time"], b.get("time_unit", "ms")))
        continue
    named = [p.split(":") for p in args.split("/") if ":" in p]
    key = tuple(int(v) for _, v in named[:3])
    if kind == "BM_TensorCore":  # one row per precision: BM_TensorCore_bf16, BM_TensorCore_tf32
        kind += "_tf32" if dict(named).get("tf32") == "1" else "_bf16"
    if kind in ("BM_SdpaBackward", "BM_SdpaForward"):  # one row per mode (the benchmark's)
        kind += "_" + dict(named).get("mode", "0")
    rows.setdefault(key, {})[kind] = (b["real_time"], b.get("TFLOP/s", 0.0))
print("attention-equivalent TFLOP/s (fp32; ms per call in brackets)")
print(f"{'N':>6} {'d':>4} {'causal':>6} {'fused':>16} {'unfused':>16} {'cuBLAS only':>16} {'fused/unfused':>14}")
def cell(r, k):
    return f"{r[k][1]:7.1f} ({r[k][0]:6.2f})" if k in r else f"{'-':>16}"
for (n, d, causal), r in sorted(rows.items(), key=lambda kv: (kv[0][2], kv[0][1], kv[0][0])):
    if not any(k in r for k in ("BM_Fused", "BM_Unfused", "BM_CublasProducts")):
        continue
    speedup = (f"{r['BM_Unfused'][0] / r['BM_Fused'][0]:14.2f}"
               if "BM_Fused" in r and "BM_Unfused" in r else f"{'-':>14}")
    print(f"{n:>6} {d:>4} {causal:>6} {cell(r, 'BM_Fused'):>16} {cell(r, 'BM_Unfused'):>16} "
          f"{cell(r, 'BM_CublasProducts'):>16} {speedup}")
peer = {k: r for k, r in rows.items() if "BM_CudnnSdpa" in r}
if peer:
    print()
    print("beside cuDNN's fused attention (bf16, same shapes; emflow's fused kernel in its precision)")
    print(f"{'N':>6} {'d':>4} {'causal':>6} {'emflow fused':>16} {'cuDNN bf16':>16} {'emflow/cuDNN':>13}")
    for (n, d, causal), r in sorted(peer.items(), key=lambda kv: (kv[0][2], kv[0][1], kv[0][0])):
        ratio = (f"{r['BM_Fused'][1] / r['BM_CudnnSdpa'][1]:13.3f}"
                 if "BM_Fused" in r and r['BM_CudnnSdpa'][1] > 0 else f"{'-':>13}")
        print(f"{n:>6} {d:>4} {causal:>6} {cell(r, 'BM_Fused'):>16} {cell(r, 'BM_CudnnSdpa'):>16} {ratio}")
tc = {k: r for k, r in rows.items() if "BM_TensorCore_bf16" in r or "BM_TensorCore_tf32" in r}
if tc:
    print()
    print("emflow's tensor-core path (cuda::attend_factored_async, rank = head dim, one head) beside cuDNN bf16")
    print(f"{'N':>6} {'d':>4} {'causal':>6} {'emflow bf16':>16} {'emflow tf32':>16} {'cuDNN bf16':>16} {'bf16/cuDNN':>11}")
    for (n, d, causal), r in sorted(tc.items(), key=lambda kv: (kv[0][2], kv[0][1], kv[0][0])):
        ratio = (f"{r['BM_TensorCore_bf16'][1] / r['BM_CudnnSdpa'][1]:11.3f}"
                 if "BM_TensorCore_bf16" in r and "BM_CudnnSdpa" in r and r['BM_CudnnSdpa'][1] > 0
                 else f"{'-':>11}")
        print(f"{n:>6} {d:>4} {causal:>6} {cell(r, 'BM_TensorCore_bf16'):>16} "
              f"{cell(r, 'BM_TensorCore_tf32'):>16} {cell(r, 'BM_CudnnSdpa'):>16} {ratio}")
back = {k: r for k, r in rows.items() if any(f"BM_SdpaBackward_{m}" in r for m in "012")}
if back:
    print()
    print("the SDPA operator's backward (cuda::sdpa_backward_async; TFLOP/s as 2.5 x the forward's 4 B N^2 d)")
    print(f"{'N':>6} {'d':>4} {'causal':>6} {'bf16':>16} {'bf16 atomics':>16} {'fp32':>16} "
          f"{'cuDNN (torch)':>16} {'bf16/cuDNN':>11}")
    for (n, d, causal), r in sorted(back.items(), key=lambda kv: (kv[0][2], kv[0][1], kv[0][0])):
        ours = max((r[k][1] for k in ("BM_SdpaBackward_0", "BM_SdpaBackward_1") if k in r),
                   default=0.0)
        peer = r.get("BM_TorchSdpaBackward_cudnn", (0.0, 0.0))[1]
        ratio = f"{ours / peer:11.3f}" if ours > 0 and peer > 0 else f"{'-':>11}"
        print(f"{n:>6} {d:>4} {causal:>6} {cell(r, 'BM_SdpaBackward_0'):>16} "
              f"{cell(r, 'BM_SdpaBackward_1'):>16} {cell(r, 'BM_SdpaBackward_2'):>16} "
              f"{cell(r, 'BM_TorchSdpaBackward_cudnn'):>16} {ratio}")
    print("  (bf16/cuDNN: emflow's faster bf16 mode over cuDNN's backward)")
forward = {k: r for k, r in rows.items() if any(f"BM_SdpaForward_{m}" in r for m in "01")}
if forward:
    print()
    print("the SDPA operator's float forward (cuda::sdpa_attend_async; 4 B N^2 d)")
    print(f"{'N':>6} {'d':>4} {'causal':>6} {'fp32 kernel':>16} {'tf32 tensor cores':>18}")
    for (n, d, causal), r in sorted(forward.items(), key=lambda kv: (kv[0][2], kv[0][1], kv[0][0])):
        print(f"{n:>6} {d:>4} {causal:>6} {cell(r, 'BM_SdpaForward_0'):>16} "
              f"{cell(r, 'BM_SdpaForward_1'):>18}")
torch_rows = {k: r for k, r in rows.items() if any(name.startswith("BM_TorchSdpa") for name in r)}
if torch_rows:
    print()
    print("PyTorch's fused SDPA on this GPU, bf16 (bench/torch_cuda_sdpa.py; backward as 2.5 x the forward's FLOP)")
    print(f"{'N':>6} {'d':>4} {'causal':>6} {'cuDNN fwd':>16} {'FA2 fwd':>16} {'cuDNN bwd':>16} {'FA2 bwd':>16}")
    for (n, d, causal), r in sorted(torch_rows.items(), key=lambda kv: (kv[0][2], kv[0][1], kv[0][0])):
        print(f"{n:>6} {d:>4} {causal:>6} {cell(r, 'BM_TorchSdpa_cudnn'):>16} "
              f"{cell(r, 'BM_TorchSdpa_flash'):>16} {cell(r, 'BM_TorchSdpaBackward_cudnn'):>16} "
              f"{cell(r, 'BM_TorchSdpaBackward_flash'):>16}")
skipped = [b for b in runs if b["name"].startswith(("BM_CudnnSdpa", "BM_TensorCore", "BM_SdpaBackward",
                                                    "BM_SdpaForward", "BM_TorchSdpa"))
           and "error_message" in b]
for b in skipped[:3]:
    print(f"  {b['name']}: {b['error_message']}")
if flow:
    print()
    print("flow on the GPU (wall clock per run; targets: phase < 2000 ms, RK4 n=d=128 < 1000 ms)")
    for name, time, unit in flow:
        print(f"  {name:<40} {time:10.1f} {unit}")
EOF
fi
