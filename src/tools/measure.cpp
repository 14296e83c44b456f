// Measuring tools for benchmarks (tools/measure.hpp), built with the vector layer of the CPU
// backend (header-only) and its compiler flags.
#include "tools/measure.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "cpu/simd.hpp"

namespace emflow::tools {

using detail::cpu::exp_nonpositive;
using detail::cpu::horizontal_sum;
using detail::cpu::kLanes;
using detail::cpu::load;
using detail::cpu::splat;
using detail::cpu::store;
using detail::cpu::Vec;

const char* compiled_instruction_set() { return detail::cpu::instruction_set(); }

double fma_peak_work(int threads, std::int64_t iterations) {
  // FMA latency (4 cycles) x FMA issue rate (up to 2 per cycle) chains keep every pipe busy.
  constexpr int kChains = kLanes == 16 ? 16 : 10;
  const int team = threads > 0 ? threads : omp_get_max_threads();
  float sink = 0.0f;
#pragma omp parallel num_threads(team) reduction(+ : sink)
  {
    Vec chain[kChains];
    for (int c = 0; c < kChains; ++c) chain[c] = splat(0.01f * static_cast<float>(c));
    // x -> 0.9999 x + 1e-4 converges to 1: no overflow, no denormals.
    const Vec scale = splat(0.9999f), shift = splat(1.0e-4f);
    for (std::int64_t i = 0; i < iterations; ++i) {
#pragma GCC unroll 16
      for (int c = 0; c < kChains; ++c) chain[c] = detail::cpu::fma(chain[c], scale, shift);
    }
    Vec total = chain[0];
    for (int c = 1; c < kChains; ++c) total += chain[c];
    sink += horizontal_sum(total);
  }
  // The sum is used, so the loop cannot be removed.
  if (!(sink > 0.0f)) return 0.0;
  return 2.0 * kLanes * kChains * static_cast<double>(iterations) * team;
}

void softmax_rows(float* scores, std::int64_t rows, std::int64_t columns, const Mask& mask,
                  int threads) {
  const int team = threads > 0 ? threads : omp_get_max_threads();
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
#pragma omp parallel for num_threads(team) schedule(static)
  for (std::int64_t i = 0; i < rows; ++i) {
    float* row = scores + i * columns;
    // Visible keys of row i form one interval [begin, end).
    std::int64_t begin = 0, end = columns;
    if (mask.kind != MaskKind::none) end = std::min(columns, i + 1);
    if (mask.kind == MaskKind::window) begin = std::max<std::int64_t>(0, i - mask.window + 1);
    std::fill(row, row + begin, 0.0f);
    std::fill(row + std::max(begin, end), row + columns, 0.0f);
    if (end <= begin) continue;
    float m = kNegInf;
    for (std::int64_t j = begin; j < end; ++j) m = std::max(m, row[j]);
    std::int64_t j = begin;
    Vec sum = Vec{};
    for (; j + kLanes <= end; j += kLanes) {
      const Vec p = exp_nonpositive(load(row + j) - splat(m));
      sum += p;
      store(row + j, p);
    }
    float total = horizontal_sum(sum);
    for (; j < end; ++j) {
      row[j] = std::exp(row[j] - m);
      total += row[j];
    }
    const float inverse = 1.0f / total;
    for (j = begin; j < end; ++j) row[j] *= inverse;
  }
}

}  // namespace emflow::tools
