#!/usr/bin/env bash
# Checks the machine code of a built emflow library (libemflow.a or .so): the CPU engine's paths
# (src/cpu/target.hpp) hold the instructions of their own level, and nothing else in the library
# holds a 256- or 512-bit vector instruction, so that the baseline code a processor without AVX2
# or AVX-512 runs never meets one. Functions of GCC's target_clones (their ".arch_x86_64_v3"
# clones, chosen by the loader from the processor) are the one other place wide vectors may be.
#
#   bash scripts/check-cpu-paths.sh build/libemflow.a
set -euo pipefail
library=${1:?usage: check-cpu-paths.sh LIBRARY}
objdump=${OBJDUMP:-objdump}
command -v "$objdump" >/dev/null || { echo "check-cpu-paths: $objdump not found" >&2; exit 2; }

"$objdump" -d -C --no-show-raw-insn "$library" | awk '
  /^[0-9a-f]+ <.*>:$/ { name = $0; next }
  name == "" { next }
  {
    wide = index($0, "%ymm") > 0
    widest = index($0, "%zmm") > 0 || index($0, "{%k") > 0
    if (!wide && !widest) next
    if (match(name, /emflow::(detail::cpu|tools)::(avx2|avx512bf16|avx512)::/)) {
      path = substr(name, RSTART, RLENGTH)
      sub(/.*::(cpu|tools)::/, "", path); sub(/::$/, "", path)
      if (path == "avx2" && widest) { bad[name] = "AVX-512 on the avx2 path"; next }
      seen[path] += widest ? 0 : 1; seen512[path] += widest ? 1 : 0
      next
    }
    if (name ~ /\[clone \.(arch_x86_64_v[34]|avx2|avx512f)/) next
    bad[name] = widest ? "AVX-512 outside the paths" : "AVX outside the paths"
  }
  END {
    failed = 0
    for (f in bad) { print "check-cpu-paths: " bad[f] ": " f; failed = 1 }
    if (seen["avx2"] == 0) { print "check-cpu-paths: the avx2 path holds no 256-bit instruction"; failed = 1 }
    if (seen512["avx512"] == 0) { print "check-cpu-paths: the avx512 path holds no AVX-512 instruction"; failed = 1 }
    if (seen512["avx512bf16"] == 0) { print "check-cpu-paths: the avx512bf16 path holds no AVX-512 instruction"; failed = 1 }
    if (!failed) printf "check-cpu-paths: ok: avx2 %d, avx512 %d, avx512bf16 %d wide instructions in the paths; none elsewhere\n", seen["avx2"], seen512["avx512"], seen512["avx512bf16"]
    exit failed
  }'
