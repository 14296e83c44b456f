// The measuring tools of tools/measure.hpp through the CPU engine's path in this process
// (measure.cpp is compiled once per path, as src/cpu is).
#include <cstdint>
#include <string>

#include "emflow/capability.hpp"
#include "emflow/error.hpp"
#include "tools/measure.hpp"

#if (defined(__x86_64__) || defined(_M_X64)) && !defined(EMFLOW_CPU_BUILT_avx2) && \
    !defined(EMFLOW_CPU_BUILT_avx512) && !defined(EMFLOW_CPU_BUILT_avx512bf16)
#error "compile with EMFLOW_CPU_BUILT_<path> for each path the build holds (CMakeLists.txt)"
#endif

namespace emflow::tools {

#define EMFLOW_TOOLS_DECLARE_PATH(name)                                                       \
  namespace name {                                                                            \
  const char* path();                                                                         \
  double fma_peak_work(int threads, std::int64_t iterations);                                 \
  void softmax_rows(float* scores, std::int64_t rows, std::int64_t columns, const Mask& mask, \
                    int threads);                                                             \
  }

#if defined(__x86_64__) || defined(_M_X64)
EMFLOW_TOOLS_DECLARE_PATH(avx2)
EMFLOW_TOOLS_DECLARE_PATH(avx512)
EMFLOW_TOOLS_DECLARE_PATH(avx512bf16)
#else
EMFLOW_TOOLS_DECLARE_PATH(generic)
#endif

namespace {

struct Path {
  const char* (*path)();
  double (*fma_peak_work)(int, std::int64_t);
  void (*softmax_rows)(float*, std::int64_t, std::int64_t, const Mask&, int);
};

#define EMFLOW_TOOLS_PATH_ENTRY(name) \
  Path { &name::path, &name::fma_peak_work, &name::softmax_rows }

/// The engine's path here; where it has none (no AVX2), the lowest, which is then refused.
const Path& taken() {
  // The build's paths (EMFLOW_CPU_BUILT_<name>: all, or the one EMFLOW_ONLY_CPU_PATH kept).
  static const Path paths[] = {
#if defined(__x86_64__) || defined(_M_X64)
#if defined(EMFLOW_CPU_BUILT_avx2)
    EMFLOW_TOOLS_PATH_ENTRY(avx2),
#endif
#if defined(EMFLOW_CPU_BUILT_avx512)
    EMFLOW_TOOLS_PATH_ENTRY(avx512),
#endif
#if defined(EMFLOW_CPU_BUILT_avx512bf16)
    EMFLOW_TOOLS_PATH_ENTRY(avx512bf16),
#endif
#else
    EMFLOW_TOOLS_PATH_ENTRY(generic),
#endif
  };
  const Machine& machine = this_machine();
  for (const Path& p : paths) {
    if (machine.cpu_instruction_set == p.path()) return p;
  }
  throw Error(ErrorCode::unsupported,
              "the measuring tools run on the CPU engine's path, and "
              "this processor has none: it lacks " +
                  machine.cpu_missing);
}

}  // namespace

const char* compiled_instruction_set() {
  const std::string& name = this_machine().cpu_instruction_set;
  return name.c_str();
}

double fma_peak_work(int threads, std::int64_t iterations) {
  return taken().fma_peak_work(threads, iterations);
}

void softmax_rows(float* scores, std::int64_t rows, std::int64_t columns, const Mask& mask,
                  int threads) {
  taken().softmax_rows(scores, rows, columns, mask, threads);
}

}  // namespace emflow::tools
