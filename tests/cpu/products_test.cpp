// The float32 products of a model's layers around attention (detail::cpu_products, the
// feed-forward block and the unembedding of a float run; detail::cpu_gated_silu): every element
// against the double product within float32's bound for a sum of `depth` products, over shapes
// that take every path (one row, whole and partial row blocks, one panel, several, a narrow last
// one), the same bits on any thread count, and silu(g) u against its double value.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "common/testing.hpp"
#include "core/backends.hpp"
#include "emflow/capability.hpp"
#include "emflow/precision.hpp"

namespace {

using emflow::detail::cpu_gated_silu;
using emflow::detail::cpu_products;
using emflow::detail::kProductColumns;
using emflow::detail::kProductPanel;
using emflow::detail::product_index;

bool engine_runs_here() { return emflow::this_machine().cpu_missing.empty(); }

std::vector<float> floats(std::int64_t count, std::uint64_t seed) {
  const std::vector<double> u = emflow::testing::uniform(static_cast<std::size_t>(count), seed);
  return std::vector<float>(u.begin(), u.end());
}

TEST(CpuProducts, EveryElementIsTheDoubleProductWithinTheFloatBound) {
  if (!engine_runs_here()) {
    GTEST_SKIP() << "the CPU engine cannot run on this processor (it lacks "
                 << emflow::this_machine().cpu_missing << "); float runs take the double loops";
  }
  struct Shape {
    std::int64_t rows, depth, columns;
  };
  for (const Shape s :
       {Shape{1, 1, kProductColumns}, Shape{1, 37, 3 * kProductPanel + 48}, Shape{5, 64, 48},
        Shape{6, 17, kProductPanel}, Shape{13, 70, kProductPanel + kProductColumns},
        Shape{32, 9, 2 * kProductPanel}}) {
    const std::vector<float> a = floats(s.rows * s.depth, 11 + s.rows);
    const std::vector<float> b = floats(s.depth * s.columns, 23 + s.columns);  // B row-major
    std::vector<float> panels(b.size());
    for (std::int64_t k = 0; k < s.depth; ++k)
      for (std::int64_t c = 0; c < s.columns; ++c)
        panels[static_cast<std::size_t>(product_index(s.depth, s.columns, k, c))] =
            b[static_cast<std::size_t>(k * s.columns + c)];
    std::vector<float> c(static_cast<std::size_t>(s.rows * s.columns),
                         std::numeric_limits<float>::quiet_NaN());
    cpu_products(a.data(), s.rows, s.depth, panels.data(), s.columns, c.data(), 1);
    double largest = 0.0;
    for (std::int64_t r = 0; r < s.rows; ++r) {
      for (std::int64_t j = 0; j < s.columns; ++j) {
        double want = 0.0, magnitude = 0.0;
        for (std::int64_t k = 0; k < s.depth; ++k) {
          const double term = static_cast<double>(a[static_cast<std::size_t>(r * s.depth + k)]) *
                              b[static_cast<std::size_t>(k * s.columns + j)];
          want += term;
          magnitude += std::abs(term);
        }
        // A float32 sum of depth products: at most depth units of rounding of sum |a b|.
        const double bound =
            static_cast<double>(s.depth + 1) * std::numeric_limits<float>::epsilon() * magnitude;
        const double got = c[static_cast<std::size_t>(r * s.columns + j)];
        ASSERT_LE(std::abs(got - want), bound) << "element (" << r << ", " << j << ") of " << s.rows
                                               << " x " << s.depth << " x " << s.columns;
        largest = std::max(largest, std::abs(want));
      }
    }
    EXPECT_GT(largest, 0.1) << "the products are not all near zero";
    for (const int threads : {2, 0}) {
      std::vector<float> again(c.size(), -1.0f);
      cpu_products(a.data(), s.rows, s.depth, panels.data(), s.columns, again.data(), threads);
      EXPECT_EQ(again, c) << threads << " threads, " << s.rows << " x " << s.depth << " x "
                          << s.columns;
    }
  }
}

TEST(CpuProducts, TheBf16ProductIsTheDoubleProductOfTheRoundedValues) {
  if (!emflow::this_machine().avx512_bf16) {
    GTEST_SKIP() << "this processor has no AVX512-BF16 (or EMFLOW_CPU_DISABLE names it): "
                    "bfloat16 products are not offered here";
  }
  using emflow::bfloat16;
  using emflow::to_bfloat16;
  using emflow::to_float;
  struct Shape {
    std::int64_t rows, depth, columns;
  };
  for (const Shape s :
       {Shape{1, 1, kProductColumns}, Shape{1, 37, 2 * kProductPanel + 48}, Shape{7, 64, 80},
        Shape{6, 17, kProductPanel}, Shape{13, 70, kProductPanel + kProductColumns}}) {
    const std::vector<float> a = floats(s.rows * s.depth, 31 + s.rows);
    const std::vector<float> b = floats(s.depth * s.columns, 41 + s.columns);
    const std::int64_t pairs = (s.depth + 1) / 2;
    std::vector<bfloat16> panels(static_cast<std::size_t>(2 * pairs * s.columns));
    for (std::int64_t k = 0; k < s.depth; ++k)
      for (std::int64_t c = 0; c < s.columns; ++c)
        panels[static_cast<std::size_t>(
            emflow::detail::product_index_bf16(s.depth, s.columns, k, c))] =
            to_bfloat16(b[static_cast<std::size_t>(k * s.columns + c)]);
    std::vector<float> c(static_cast<std::size_t>(s.rows * s.columns),
                         std::numeric_limits<float>::quiet_NaN());
    emflow::detail::cpu_products_bf16(a.data(), s.rows, s.depth, panels.data(), s.columns, c.data(),
                                      1);
    for (std::int64_t r = 0; r < s.rows; ++r) {
      for (std::int64_t j = 0; j < s.columns; ++j) {
        double want = 0.0, magnitude = 0.0;
        for (std::int64_t k = 0; k < s.depth; ++k) {
          const double term = static_cast<double>(to_float(
                                  to_bfloat16(a[static_cast<std::size_t>(r * s.depth + k)]))) *
                              to_float(to_bfloat16(b[static_cast<std::size_t>(k * s.columns + j)]));
          want += term;
          magnitude += std::abs(term);
        }
        const double bound =
            static_cast<double>(s.depth + 1) * std::numeric_limits<float>::epsilon() * magnitude;
        ASSERT_LE(std::abs(c[static_cast<std::size_t>(r * s.columns + j)] - want), bound)
            << "element (" << r << ", " << j << ") of " << s.rows << " x " << s.depth << " x "
            << s.columns;
      }
    }
    for (const int threads : {2, 0}) {
      std::vector<float> again(c.size(), -1.0f);
      emflow::detail::cpu_products_bf16(a.data(), s.rows, s.depth, panels.data(), s.columns,
                                        again.data(), threads);
      EXPECT_EQ(again, c) << threads << " threads";
    }
  }
}

TEST(CpuProducts, GatedSiluIsTheDoubleValue) {
  if (!engine_runs_here()) {
    GTEST_SKIP() << "the CPU engine cannot run on this processor (it lacks "
                 << emflow::this_machine().cpu_missing << ")";
  }
  const std::int64_t rows = 3, inner = 2 * kProductColumns;
  std::vector<float> gate_up = floats(rows * 2 * inner, 5);
  for (float& v : gate_up) v *= 12.0f;  // gates from -12 to 12
  // The ends of the range: silu of a large negative gate is 0 (no overflow of exp(-g)), of a
  // large positive one the gate itself.
  gate_up[0] = -200.0f;
  gate_up[1] = 200.0f;
  gate_up[2] = 0.0f;
  gate_up[3] = -1e-30f;
  std::vector<float> hidden(static_cast<std::size_t>(rows * inner), -1.0f);
  cpu_gated_silu(gate_up.data(), rows, inner, hidden.data());
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t k = 0; k < inner; ++k) {
      const double g = gate_up[static_cast<std::size_t>(r * 2 * inner + k)];
      const double u = gate_up[static_cast<std::size_t>(r * 2 * inner + inner + k)];
      const double want = g / (1.0 + std::exp(-g)) * u;
      const double got = hidden[static_cast<std::size_t>(r * inner + k)];
      // A value below float32's smallest normal is 0 (silu(-200) u is about 1e-84).
      EXPECT_LE(std::abs(got - want), 8 * std::numeric_limits<float>::epsilon() * std::abs(want) +
                                          std::numeric_limits<float>::min())
          << "gate " << g << " up " << u;
    }
  }
  EXPECT_EQ(hidden[0], 0.0f);
  EXPECT_EQ(hidden[1], 200.0f * gate_up[static_cast<std::size_t>(inner + 1)]);
}

}  // namespace
