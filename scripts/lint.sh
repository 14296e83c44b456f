#!/usr/bin/env bash
# The tree's static checks, over the whole tree; any finding fails.
#
#   format  every C++ and CUDA file that git tracks is as .clang-format writes it (checked without
#           changing a file), and no line of them is longer than 100 columns (the comment lines
#           that .clang-format's CommentPragmas keeps as written included);
#   tidy    the checks of .clang-tidy over every translation unit of this tree in a build's
#           compilation database (default build/, the build scripts/test.sh makes), run in
#           parallel, with the findings in the tree's own headers; CUDA device code (.cu) is not
#           parsed (nvcc's flags), nor are the fuzzers (built only by scripts/fuzz.sh).
#
#   bash scripts/lint.sh                 both
#   bash scripts/lint.sh format          the format check alone
#   bash scripts/lint.sh tidy [FILE...]  clang-tidy alone, on the named sources (default: all)
#   bash scripts/lint.sh fix-format      rewrite every file clang-format would change (-i)
#
# Environment: LINT_BUILD (build), LINT_JOBS (every core), CLANG_FORMAT (clang-format-14),
# CLANG_TIDY (clang-tidy-22). The versions matter: another clang-format lays some lines out
# differently, and another clang-tidy has other checks.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
build=${LINT_BUILD:-build}
jobs=${LINT_JOBS:-$(nproc 2>/dev/null || echo 2)}
clang_format=${CLANG_FORMAT:-clang-format-14}
clang_tidy=${CLANG_TIDY:-clang-tidy-22}
what=${1:-all}
shift || true
say() { echo "lint.sh: $*"; }

need() {
  command -v "$1" >/dev/null || { say "$1 not found (Debian: apt-get install $2)"; exit 2; }
}

sources() { git ls-files -- '*.cpp' '*.hpp' '*.h' '*.cu' '*.cuh'; }

check_format() {
  need "$clang_format" "${clang_format}"
  local start status=0 files
  start=$(date +%s)
  mapfile -t files < <(sources)
  local changed
  changed=$(printf '%s\0' "${files[@]}" | xargs -0 -n 16 -P "$jobs" sh -c '
    for f; do "$0" --style=file "$f" | cmp -s - "$f" || echo "$f"; done' "$clang_format" | sort)
  if [[ -n "$changed" ]]; then
    say "$(echo "$changed" | wc -l) files are not as $clang_format writes them" \
        "(bash scripts/lint.sh fix-format rewrites them):"
    echo "$changed" | sed 's/^/  /'
    status=1
  fi
  local long
  long=$(printf '%s\0' "${files[@]}" | LC_ALL=C.UTF-8 xargs -0 grep -nE '^.{101,}' |
    cut -d: -f1,2 | sed 's/^/  /' || true)
  if [[ -n "$long" ]]; then
    say "lines longer than 100 columns:"; echo "$long"; status=1
  fi
  say "format: ${#files[@]} files checked in $(($(date +%s) - start)) s"
  return $status
}

fix_format() {
  need "$clang_format" "${clang_format}"
  sources | xargs -n 16 -P "$jobs" "$clang_format" --style=file -i
}

check_tidy() {
  need "$clang_tidy" "${clang_tidy}"
  local database=$build/compile_commands.json
  if [[ ! -f "$database" ]]; then
    say "$database not found: build first (scripts/test.sh, or cmake -B $build with" \
        "CMAKE_EXPORT_COMPILE_COMMANDS=ON, which a top-level configure sets)"
    return 2
  fi
  local units=("$@")
  if [[ ${#units[@]} -eq 0 ]]; then
    # The tree's C++ translation units in the database: the .cpp files git tracks. Not a path
    # prefix: the Python environment (.venv) sits inside the tree, and nanobind's own sources,
    # which the Python module compiles from it, are not ours to lint.
    mapfile -t units < <(git ls-files -z -- '*.cpp' | python3 -c '
import json, os, sys
database, root = sys.argv[1], os.path.realpath(sys.argv[2])
tracked = {os.path.realpath(os.path.join(root, f)) for f in sys.stdin.read().split("\0") if f}
seen = set()
for entry in json.load(open(database)):
    path = os.path.realpath(os.path.join(entry["directory"], entry["file"]))
    if path in tracked and path not in seen:
        seen.add(path)
        print(path)' "$database" "$root")
  fi
  # The database holds GCC's command lines, which clang reads: GCC's warning flags it does not
  # know (-Wno-psabi) are let pass, and GCC's own omp.h is found after clang's headers (clang
  # ships none without its libomp).
  local extra=(--extra-arg=-Wno-unknown-warning-option --extra-arg=-Wno-error)
  local gcc_include
  gcc_include=$(g++ -print-file-name=include 2>/dev/null || true)
  if [[ -f "$gcc_include/omp.h" ]]; then extra+=("--extra-arg=-idirafter$gcc_include"); fi
  local start log
  start=$(date +%s)
  log=$(mktemp -d)
  # Findings in the tree's headers are shown (not in the system's, nanobind's or GoogleTest's).
  printf '%s\0' "${units[@]}" | xargs -0 -P "$jobs" -I{} sh -c '
    tidy=$1 log=$2 build=$3 root=$4 unit=$5; shift 5
    out="$log/$(echo "$unit" | tr / _).log"
    ours="^$root/(include|src|kernels|tests|bench|python/src)/"
    "$tidy" -p "$build" --quiet --header-filter="$ours" "$@" "$unit" >"$out" 2>&1 ||
      echo "clang-tidy exit status $? on $unit" >>"$out"' \
    sh "$clang_tidy" "$log" "$build" "$root" "{}" "${extra[@]}"
  # A header's finding shows once for every unit that includes it: each finding once.
  local findings
  findings=$(cat "$log"/*.log | grep -E '(warning|error): |clang-tidy exit status' |
    sed "s|^$root/||" | sort -u || true)
  rm -rf "$log"
  say "tidy: ${#units[@]} translation units in $(($(date +%s) - start)) s"
  if [[ -n "$findings" ]]; then
    say "$(echo "$findings" | grep -c ': warning: ' || true) findings:"
    echo "$findings"
    return 1
  fi
}

status=0
case $what in
  format) check_format || status=$? ;;
  fix-format) fix_format ;;
  tidy) check_tidy "$@" || status=$? ;;
  all)
    check_format || status=$?
    check_tidy || status=$?
    ;;
  *) say "unknown command '$what' (format, tidy, fix-format, or none for both)"; exit 2 ;;
esac
if ((status)); then say "FAILED"; else say "passed"; fi
exit $status
