// The bfloat16 products of a model's layers around attention (backends.hpp, cpu_products_bf16):
// the rows of A rounded to bfloat16 once, B's bfloat16 pairs in panels, and vdpbf16ps summing
// each pair of products into float32 lanes. As products.cpp, panel by panel of B's columns.
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "avx512_bf16.hpp"
#include "core/backends.hpp"
#include "emflow/precision.hpp"

namespace emflow::detail {

namespace {

// C[R x 16 NV] = A[R x 2 pairs] B[2 pairs x 16 NV]: a holds each row's pairs as 32-bit words
// (element 2p in the low half), b a panel's pair rows of `width` columns (2 width halves each).
template <int R, int NV>
EMFLOW_BF16_TARGET void pair_kernel(const std::uint32_t* a, std::int64_t lda, std::int64_t pairs,
                                    const std::uint16_t* b, std::int64_t width, float* c,
                                    std::int64_t ldc) {
  __m512 acc[R][NV];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  }
  for (std::int64_t p = 0; p < pairs; ++p) {
    const std::uint16_t* row = b + p * 2 * width;
    __m512bh bv[NV];
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) bv[v] = (__m512bh)_mm512_loadu_si512(row + v * 32);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[r * lda + p]));
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], av, bv[v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(c + r * ldc + v * 16, acc[r][v]);
  }
}

// Rows [r0, r0 + R) of C against one panel: the widest kernel, then one vector at a time.
template <int R, int NV>
EMFLOW_BF16_TARGET void panel_rows(const std::uint32_t* a, std::int64_t lda, std::int64_t pairs,
                                   const std::uint16_t* panel, std::int64_t width, float* c,
                                   std::int64_t ldc) {
  const std::int64_t vectors = width / 16;
  std::int64_t v = 0;
  for (; v + NV <= vectors; v += NV) {
    pair_kernel<R, NV>(a, lda, pairs, panel + v * 32, width, c + v * 16, ldc);
  }
  for (; v < vectors; ++v) pair_kernel<R, 1>(a, lda, pairs, panel + v * 32, width, c + v * 16, ldc);
}

}  // namespace

void cpu_products_bf16(const float* A, std::int64_t rows, std::int64_t depth, const bfloat16* B,
                       std::int64_t columns, float* C, int threads) {
  static_assert(kProductPanel % 16 == 0 && kProductColumns % 16 == 0, "whole vectors of floats");
  // A's rows rounded to bfloat16 once, as pairs (an odd depth ends with a zero).
  const std::int64_t pairs = (depth + 1) / 2;
  std::vector<std::uint32_t> a(static_cast<std::size_t>(rows * pairs), 0u);
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t k = 0; k < depth; ++k) {
      const std::uint32_t bits = to_bfloat16(A[r * depth + k]).bits;
      a[static_cast<std::size_t>(r * pairs + k / 2)] |= k % 2 == 0 ? bits : bits << 16;
    }
  }
  const auto* b = reinterpret_cast<const std::uint16_t*>(B);
  const std::int64_t panels = (columns + kProductPanel - 1) / kProductPanel;
  const double work =
      static_cast<double>(rows) * static_cast<double>(depth) * static_cast<double>(columns);
  const int team = threads > 0 ? threads : work < 2.5e5 ? 1 : omp_get_max_threads();
  constexpr int kRows = 6;
#pragma omp parallel for schedule(static) num_threads(team) if (team > 1 && panels > 1)
  for (std::int64_t p = 0; p < panels; ++p) {
    const std::int64_t c0 = p * kProductPanel, width = std::min(kProductPanel, columns - c0);
    const std::uint16_t* panel = b + c0 * 2 * pairs;
    std::int64_t r = 0;
    for (; r + kRows <= rows; r += kRows) {
      panel_rows<kRows, 4>(a.data() + r * pairs, pairs, pairs, panel, width, C + r * columns + c0,
                           columns);
    }
    for (; r < rows; ++r) {  // the last rows, and one row of a decoding step: a panel's stream
      panel_rows<1, 16>(a.data() + r * pairs, pairs, pairs, panel, width, C + r * columns + c0,
                        columns);
    }
  }
}

}  // namespace emflow::detail
