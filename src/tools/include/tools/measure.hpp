// Measuring tools for `emflow bench` and the CPU benchmarks, built once per path of the CPU
// engine and run on the path it takes, so they use the same vector instructions: the machine's
// fp32 FMA rate and the row softmax of the unfused baseline.
#pragma once

#include <cstdint>

#include "emflow/types.hpp"

namespace emflow::tools {

/// The CPU engine's path in this process (Machine::cpu_instruction_set: "avx512bf16",
/// "avx512", "avx2", ...), which the two functions below run on.
const char* compiled_instruction_set();

/// Runs `iterations` steps of independent FMA chains (enough of them to hide the FMA latency,
/// so the loop is throughput-bound) on each of `threads` OpenMP threads (0: the default) and
/// returns the floating-point operations done (2 per lane per FMA). Time it to get the rate.
double fma_peak_work(int threads, std::int64_t iterations);

/// Softmax of each row of the rows x columns `scores` (row-major, in place) over the keys the
/// mask lets row i see (keys j with mask.allows(i, j)); weights of other keys become 0. Used by
/// the unfused baseline, which holds the whole N x N matrix. OpenMP over rows.
void softmax_rows(float* scores, std::int64_t rows, std::int64_t columns, const Mask& mask,
                  int threads);

}  // namespace emflow::tools
