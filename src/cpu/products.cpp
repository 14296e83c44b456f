// Dense float32 products for the parts of a model's layer around attention (its feed-forward
// block and the unembedding, src/model/): C = A B by the engine's register-blocked micro-kernel
// (simd.hpp), panel by panel of B's columns: each panel is contiguous, so that one row (a
// decoding step) streams it from memory, and many rows (a prompt) meet it in the L2 cache.

#include <algorithm>

#include "core/backends.hpp"
#include "engine_internal.hpp"
#include "product_tasks.hpp"
#include "simd.hpp"
#include "target.hpp"

EMFLOW_CPU_BEGIN

namespace {
// The register block of a product: rows x vectors accumulators, with a row of B in registers and
// one broadcast of A. AVX-512 has 32 vector registers: 6 x 4 = 24 accumulators, 10 loads per 24
// FMAs (the attention engine's 8 x 2 issues 10 per 16); elsewhere the engine's block.
#if EMFLOW_CPU_AVX512
constexpr int kRows = 6, kVectors = 4;
#else
constexpr int kRows = engine::kChunkRows, kVectors = max_vectors(kRows);
#endif
}  // namespace

void cpu_products(const float* A, std::int64_t rows, std::int64_t depth, const float* B,
                  std::int64_t columns, float* C, int threads) {
  static_assert(kProductColumns % kLanes == 0 && kProductPanel % kProductColumns == 0,
                "a padded row holds whole vectors");
  const ProductTasks tasks = product_tasks(rows, depth, columns, threads, kRows);
#pragma omp parallel for schedule(static) \
    num_threads(tasks.team) if (tasks.team > 1 && tasks.count() > 1)
  for (std::int64_t task = 0; task < tasks.count(); ++task) {
    const auto [p, first, last] = tasks.at(task, rows);
    const std::int64_t c0 = p * kProductPanel, width = std::min(kProductPanel, columns - c0);
    const float* panel = B + c0 * depth;
    const std::int64_t vectors = width / kLanes;
    std::int64_t r = first;
    for (; r + kRows <= last; r += kRows) {
      const float* a = A + r * depth;
      float* c = C + r * columns + c0;
      std::int64_t v = 0;
      for (; v + kVectors <= vectors; v += kVectors) {
        micro_kernel<kRows, kVectors>(depth, a, depth, panel + v * kLanes, width, c + v * kLanes,
                                      columns, false);
      }
      if (v < vectors) {
        micro_kernel_remainder<kRows, kVectors - 1>(vectors - v, depth, a, depth,
                                                    panel + v * kLanes, width, c + v * kLanes,
                                                    columns, false);
      }
    }
    for (; r < last; ++r) {  // the last rows, and one row of a decoding step: a panel's stream
      row_block_gemm<1>(depth, A + r * depth, depth, panel, width, width, C + r * columns + c0,
                        columns, false);
    }
  }
}

void cpu_gated_silu(const float* gate_up, std::int64_t rows, std::int64_t inner, float* hidden) {
  const Vec one = splat(1.0f), zero{};
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* g = gate_up + r * 2 * inner;
    const float* u = g + inner;
    float* h = hidden + r * inner;
    for (std::int64_t k = 0; k < inner; k += kLanes) {
      // sigmoid(x) = 1 / (1 + e) for x >= 0, e / (1 + e) below, with e = exp(-|x|) <= 1.
      const Vec x = load(g + k);
      const Vec negative = x < zero ? x : -x;
      const Vec e = exp_nonpositive(negative);
      const Vec sigmoid = (x < zero ? e : one) / (one + e);
      store(h + k, x * sigmoid * load(u + k));
    }
  }
}

EMFLOW_CPU_END
