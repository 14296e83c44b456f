#!/usr/bin/env bash
# Shows that a CPU build (EMFLOW_WITH_CUDA=OFF) needs no part of the CUDA toolkit: it builds with
# the toolkit hidden, then checks that nothing the build read or linked came from it.
#
#   bash scripts/check-cpu-only-build.sh          configure build-cpu-only with
#                                                 EMFLOW_WITH_CUDA=OFF, build the library, the CLI
#                                                 and the core test suite, and run that suite
#   bash scripts/check-cpu-only-build.sh CMD...   run CMD with the toolkit hidden instead (CI: the
#                                                 sanitizer build, a CPU build already, so the
#                                                 check costs no compilation of its own)
#
# Hiding: each toolkit folder (where nvcc, CUDA_HOME, CUDA_PATH and /usr/local/cuda lead) is
# covered by an empty read-only tmpfs in a mount namespace of the command's own (`unshare -m`,
# or `unshare -rm` for a user who is not root), so its files and every link into it from
# elsewhere (a toolkit linked into /usr/local/include is on every compiler's default path) are
# gone for that command alone. Before the command runs, the compiler must fail to find
# cuda_runtime.h, cublas_v2.h and nccl.h and nvcc must fail to run, or the check fails.
#
# After the command, in each build folder named by CPU_ONLY_SCAN (default: the one this script
# builds): its CMake cache must not know a CUDA compiler, CUDAToolkit or NCCL (a CPU build looks
# for none), no header that a compiler read (the dependency files of the build) and no library
# on a link line may lie in the toolkit, and no binary may need libcudart, libcublas or libnccl.
# Where no mount namespace can be made (a container without the right to), the toolkit stays
# visible and these checks alone are the evidence; the script says so.
#
# Environment: CPU_ONLY_BUILD (build-cpu-only), CPU_ONLY_SCAN (build folders to check after a
# command), CPU_ONLY_JOBS (every core), CMAKE_CXX_COMPILER_LAUNCHER (e.g. ccache) is honoured.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${CPU_ONLY_BUILD:-build-cpu-only}
jobs=${CPU_ONLY_JOBS:-$(nproc 2>/dev/null || echo 2)}
say() { echo "check-cpu-only-build: $*"; }

# The toolkit folders, resolved through links, that exist on this machine.
toolkit_roots() {
  local candidates=() root
  [[ -n "${CUDA_HOME:-}" ]] && candidates+=("$CUDA_HOME")
  [[ -n "${CUDA_PATH:-}" ]] && candidates+=("$CUDA_PATH")
  candidates+=(/usr/local/cuda)
  if command -v nvcc >/dev/null 2>&1; then
    # A wrapper script (exec /opt/cuda/bin/nvcc "$@") leads to the toolkit only through its text.
    local nvcc
    nvcc=$(command -v nvcc)
    candidates+=("$(dirname "$(dirname "$(readlink -f "$nvcc")")")")
    root=$(sed -n 's|^exec \(/[^ "]*\)/bin/nvcc.*|\1|p' "$nvcc" 2>/dev/null | head -n 1)
    [[ -n "$root" ]] && candidates+=("$root")
  fi
  # A toolkit holds its headers itself: a folder whose include/cuda_runtime.h is only a link into
  # one (/usr/local, reached through a wrapper /usr/local/bin/nvcc) is not a root, and hiding it
  # would hide everything else installed there.
  for root in "${candidates[@]}"; do
    [[ -f "$root/include/cuda_runtime.h" && ! -L "$root/include/cuda_runtime.h" ]] &&
      readlink -f "$root"
  done | sort -u | awk '{ for (i = 1; i <= n; i++) if (index($0, kept[i] "/") == 1) next
                          kept[++n] = $0; print }'
}

# The build the script makes when given no command: the library, the CLI and one test suite,
# without optimisation (the point is what compiles and links, not speed).
default_build() {
  mkdir -p "$build"
  cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG=-O0 \
    -DEMFLOW_WITH_CUDA=OFF -DEMFLOW_BUILD_TESTS=ON -DEMFLOW_BUILD_CLI=ON \
    -DEMFLOW_BUILD_BENCHMARKS=OFF -DEMFLOW_BUILD_PYTHON=OFF -DEMFLOW_PYTHON= \
    -DEMFLOW_WARNINGS_AS_ERRORS=ON >"$build/configure.log" 2>&1 ||
    { cat "$build/configure.log" >&2; exit 1; }
  cmake --build "$build" -j "$jobs" --target emflow emflow_cli emflow_core_tests
  "$build/tests/emflow_core_tests" --gtest_brief=1
}

# The checks of one build folder against the toolkit folders in $roots (see the header).
scan_build() {
  local dir=$1 failed=0 root
  if [[ ! -f "$dir/CMakeCache.txt" ]]; then
    say "$dir: no CMake build folder to check"; return 1
  fi
  if grep -E '^EMFLOW_WITH_CUDA:BOOL=(ON|1|TRUE)' "$dir/CMakeCache.txt" >/dev/null; then
    say "$dir: configured with EMFLOW_WITH_CUDA=ON, not a CPU build"; return 1
  fi
  local looked
  local pattern='^(CMAKE_CUDA_COMPILER|CUDAToolkit_[A-Za-z_]*|CUDA_[A-Za-z_]*|EMFLOW_NCCL_[A-Z_]*):'
  looked=$(grep -E "$pattern" "$dir/CMakeCache.txt" || true)
  if [[ -n "$looked" ]]; then
    say "$dir: the CPU build looked for the CUDA toolkit:"; echo "$looked" | head -n 5; failed=1
  fi
  # Every header a compiler read: the dependency files (gcc/clang -MD) of every object.
  local headers
  headers=$(find "$dir" \( -name '*.o.d' -o -name 'compiler_depend.make' -o -name 'depend.make' \) \
    -print0 | xargs -0 -r cat | tr ' \\' '\n\n' | sed -n 's/:$//; /^\//p' | sort -u)
  if [[ -z "$headers" ]]; then
    say "$dir: no dependency files: nothing was compiled there"; return 1
  fi
  local links
  links=$(find "$dir" -name link.txt -print0 | xargs -0 -r cat)
  for root in $roots; do
    local from
    from=$(echo "$headers" | xargs -r readlink -f 2>/dev/null | grep -F "$root/" || true)
    if [[ -n "$from" ]]; then
      say "$dir: headers of the toolkit were compiled:"; echo "$from" | head -n 5; failed=1
    fi
    if echo "$links" | grep -F "$root" >/dev/null; then
      say "$dir: a link line names the toolkit ($root)"; failed=1
    fi
  done
  # Links into the toolkit from a default folder (/usr/local/include, /usr/local/lib) resolve
  # only when it is visible; the names say it either way.
  local named
  named=$(echo "$headers" |
    grep -E '/(cuda_runtime[a-z_]*|cuda|cublas[A-Za-z_0-9]*|nccl|driver_types)\.h$' || true)
  if [[ -n "$named" ]]; then
    say "$dir: CUDA headers were compiled:"; echo "$named" | head -n 5; failed=1
  fi
  if echo "$links" | grep -E -- '-l(cudart|cublas|nccl)\b|lib(cudart|cublas|nccl)[._]' >/dev/null
  then
    say "$dir: a link line names the CUDA runtime, cuBLAS or NCCL"; failed=1
  fi
  local binary needed
  while IFS= read -r -d '' binary; do
    needed=$(readelf -d "$binary" 2>/dev/null | grep -E 'NEEDED.*lib(cudart|cublas|nccl)' || true)
    if [[ -n "$needed" ]]; then say "$binary needs: $needed"; failed=1; fi
  done < <(find "$dir" -type f \( -perm -u+x -o -name '*.so' \) -size +8k -print0)
  local count
  count=$(echo "$headers" | wc -l)
  if ((failed)); then return 1; fi
  say "$dir: no CUDA header among the $count files the compilers read, no CUDA library linked"
}

if [[ -z "${EMFLOW_CPU_ONLY_INSIDE:-}" ]]; then
  roots=$(toolkit_roots | tr '\n' ' ')
  roots=${roots% }
  mode=absent
  if [[ -n "$roots" ]]; then
    unshare=(unshare -m)
    [[ "$(id -u)" -eq 0 ]] || unshare=(unshare -rm)
    first=${roots%% *}
    # Whether this machine lets us make the namespace and mount in it at all.
    if "${unshare[@]}" sh -c "mount -t tmpfs -o ro,size=4k none '$first'" 2>/dev/null; then
      mode=hidden
    else
      mode=visible
    fi
  fi
  case $mode in
    absent) say "no CUDA toolkit on this machine: nothing to hide" ;;
    hidden) say "hiding the CUDA toolkit ($roots) in a mount namespace of the command's own" ;;
    visible) say "cannot make a mount namespace here: the toolkit ($roots) stays visible, and" \
                 "the checks of what the build read and linked are the evidence" ;;
  esac
  status=0
  if [[ $mode == hidden ]]; then
    EMFLOW_CPU_ONLY_INSIDE=1 EMFLOW_CPU_ONLY_ROOTS="$roots" EMFLOW_CPU_ONLY_MODE=$mode \
      "${unshare[@]}" bash "$0" "$@" || status=$?
  else
    EMFLOW_CPU_ONLY_INSIDE=1 EMFLOW_CPU_ONLY_ROOTS="$roots" EMFLOW_CPU_ONLY_MODE=$mode \
      bash "$0" "$@" || status=$?
  fi
  exit $status
fi

# From here on: inside the namespace (or without one).
roots=$EMFLOW_CPU_ONLY_ROOTS
if [[ $EMFLOW_CPU_ONLY_MODE == hidden ]]; then
  for root in $roots; do
    mount -t tmpfs -o ro,size=4k,mode=755 emflow-no-cuda "$root"
  done
  for header in cuda_runtime.h cublas_v2.h nccl.h; do
    if printf '#include <%s>\n' "$header" | "${CXX:-c++}" -fsyntax-only -x c++ - 2>/dev/null; then
      say "the compiler still finds $header with the toolkit hidden: cannot check"; exit 1
    fi
  done
  if nvcc --version >/dev/null 2>&1; then
    say "nvcc still runs with the toolkit hidden ($(command -v nvcc)): cannot check"; exit 1
  fi
  say "hidden: the compiler finds no cuda_runtime.h, cublas_v2.h or nccl.h; nvcc does not run"
fi
# Nothing of the toolkit's through the environment either: its variables unset, its folders
# taken out of the search paths.
without_toolkit() {
  local entries entry root keep kept=
  IFS=: read -r -a entries <<<"$1"
  for entry in "${entries[@]}"; do
    keep=1
    for root in $roots; do [[ "$(readlink -m "$entry")" == "$root"* ]] && keep=0; done
    ((keep)) && kept+="${kept:+:}$entry"
  done
  echo "$kept"
}
unset CUDA_HOME CUDA_PATH CUDAToolkit_ROOT CUDACXX
PATH=$(without_toolkit "$PATH")
for variable in LIBRARY_PATH LD_LIBRARY_PATH CPATH CPLUS_INCLUDE_PATH CMAKE_PREFIX_PATH; do
  if [[ -n "${!variable:-}" ]]; then
    value=$(without_toolkit "${!variable}")
    if [[ -n "$value" ]]; then export "$variable=$value"; else unset "$variable"; fi
  fi
done

start=$(date +%s)
if [[ $# -gt 0 ]]; then
  say "running: $*"
  "$@"
  scan=${CPU_ONLY_SCAN:-}
  [[ -n "$scan" ]] || say "CPU_ONLY_SCAN names no build folder: only the hiding is checked"
else
  default_build
  scan=$build
fi
say "the build took $(($(date +%s) - start)) s"
failed=0
for dir in $scan; do scan_build "$dir" || failed=1; done
if ((failed)); then say "FAILED: the CPU build used the CUDA toolkit"; exit 1; fi
say "passed (toolkit ${EMFLOW_CPU_ONLY_MODE})"
