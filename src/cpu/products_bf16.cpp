// The bfloat16 products of a model's layers around attention (backends.hpp, cpu_products_bf16):
// the rows of A rounded to bfloat16 once, B's bfloat16 pairs in panels, and the vdpbf16ps
// micro-kernel of avx512_bf16.hpp summing each pair of products into float32 lanes. As
// products.cpp, panel by panel of B's columns.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "avx512_bf16.hpp"
#include "core/backends.hpp"
#include "emflow/precision.hpp"
#include "product_tasks.hpp"
#include "target.hpp"

#if EMFLOW_CPU_AVX512BF16  // the avx512bf16 path only

EMFLOW_CPU_BEGIN

namespace {

// R rows of C against one panel (a row of `width` words per pair of depth rows): the widest
// micro-kernel (avx512_bf16.hpp), then one vector at a time.
template <int R, int NV>
void panel_rows(const Word* a, std::int64_t lda, std::int64_t pairs, const Word* panel,
                std::int64_t width, float* c, std::int64_t ldc) {
  const std::int64_t vectors = width / 16;
  std::int64_t v = 0;
  for (; v + NV <= vectors; v += NV) {
    dp_kernel<R, NV, false, false>(pairs, a, lda, panel + v * 16, width, c + v * 16, ldc);
  }
  for (; v < vectors; ++v) {
    dp_kernel<R, 1, false, false>(pairs, a, lda, panel + v * 16, width, c + v * 16, ldc);
  }
}

}  // namespace

void cpu_products_bf16(const float* A, std::int64_t rows, std::int64_t depth, const bfloat16* B,
                       std::int64_t columns, float* C, int threads) {
  static_assert(kProductPanel % 16 == 0 && kProductColumns % 16 == 0, "whole vectors of floats");
  // A's rows rounded to bfloat16 once, as pairs (an odd depth ends with a zero).
  const std::int64_t pairs = (depth + 1) / 2;
  std::vector<Word> a(static_cast<std::size_t>(rows * pairs), 0u);
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t k = 0; k < depth; ++k) {
      const Word bits = to_bfloat16(A[r * depth + k]).bits;
      a[static_cast<std::size_t>(r * pairs + k / 2)] |= k % 2 == 0 ? bits : bits << 16;
    }
  }
  // B's pairs as words: a panel of width w holds a row of w words per pair of depth rows.
  const auto* b = reinterpret_cast<const Word*>(B);
  constexpr int kRows = 6;
  const ProductTasks tasks = product_tasks(rows, depth, columns, threads, kRows);
#pragma omp parallel for schedule(static) \
    num_threads(tasks.team) if (tasks.team > 1 && tasks.count() > 1)
  for (std::int64_t task = 0; task < tasks.count(); ++task) {
    const auto [p, first, last] = tasks.at(task, rows);
    const std::int64_t c0 = p * kProductPanel, width = std::min(kProductPanel, columns - c0);
    const Word* panel = b + c0 * pairs;
    std::int64_t r = first;
    for (; r + kRows <= last; r += kRows) {
      panel_rows<kRows, 4>(a.data() + r * pairs, pairs, pairs, panel, width, C + r * columns + c0,
                           columns);
    }
    for (; r < last; ++r) {  // the last rows, and one row of a decoding step: a panel's stream
      panel_rows<1, 16>(a.data() + r * pairs, pairs, pairs, panel, width, C + r * columns + c0,
                        columns);
    }
  }
}

EMFLOW_CPU_END

#endif  // EMFLOW_CPU_AVX512BF16
