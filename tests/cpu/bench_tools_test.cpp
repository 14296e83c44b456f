// The measuring tools behind `emflow bench` and the CPU benchmarks (src/tools): the unfused
// OpenBLAS baseline computes the update the float64 reference computes, under every mask, and
// its row softmax is a distribution over exactly the visible keys.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "emflow/attention.hpp"
#include "tools/blas_baseline.hpp"
#include "tools/measure.hpp"
#include "tools/problem.hpp"

namespace {

using emflow::Mask;

TEST(BlasBaseline, MatchesTheReferenceUnderEveryMask) {
  const std::int64_t B = 2, N = 37, d = 8, H = 3;
  for (const Mask& mask : {Mask::none(), Mask::causal(), Mask::sliding_window(5)}) {
    SCOPED_TRACE(emflow::to_string(mask));
    emflow::tools::BenchProblem p(B, N, d, H, mask);
    const std::vector<double> cloud(p.cloud.begin(), p.cloud.end());
    const std::vector<double> relevance(p.relevance.begin(), p.relevance.end());
    const std::vector<double> content(p.content.begin(), p.content.end());
    emflow::AttentionInput<double> input =
        emflow::tools::layer_input(cloud.data(), B, N, d, H, relevance.data(), content.data());
    input.mask = mask;
    std::vector<double> expected(cloud.size());
    emflow::attend(input, {expected.data(), nullptr, nullptr, nullptr},
                   {emflow::Device::reference});

    emflow::tools::BlasBaseline baseline(N, d);
    EXPECT_GE(baseline.bytes(), 4 * N * N);
    baseline.run(p.input, p.update.data(), 1);
    double diff = 0, norm = 0;
    for (std::size_t i = 0; i < expected.size(); ++i) {
      diff += (p.update[i] - expected[i]) * (p.update[i] - expected[i]);
      norm += expected[i] * expected[i];
    }
    ASSERT_GT(norm, 1e-2 * static_cast<double>(expected.size()));  // not a zero update
    EXPECT_LT(std::sqrt(diff / norm), 1e-5);
  }
}

TEST(SoftmaxRows, WeighsExactlyTheVisibleKeys) {
  const std::int64_t n = 9;
  const Mask mask = Mask::sliding_window(3);
  std::vector<float> scores(static_cast<std::size_t>(n * n));
  for (std::int64_t k = 0; k < n * n; ++k) scores[static_cast<std::size_t>(k)] = 0.1f * (k % 7);
  const std::vector<float> raw = scores;
  emflow::tools::softmax_rows(scores.data(), n, n, mask, 1);
  for (std::int64_t i = 0; i < n; ++i) {
    double total = 0, z = 0;
    for (std::int64_t j = 0; j < n; ++j) {
      if (mask.allows(i, j)) z += std::exp(double(raw[static_cast<std::size_t>(i * n + j)]));
    }
    for (std::int64_t j = 0; j < n; ++j) {
      const auto k = static_cast<std::size_t>(i * n + j);
      const double want = mask.allows(i, j) ? std::exp(double(raw[k])) / z : 0.0;
      EXPECT_NEAR(scores[k], want, 1e-6) << i << ", " << j;
      total += scores[k];
    }
    EXPECT_NEAR(total, 1.0, 1e-6) << i;
  }
}

TEST(FmaPeak, ReportsTheWorkOfItsIterations) {
  const double once = emflow::tools::fma_peak_work(1, 1000);
  EXPECT_GT(once, 0.0);
  EXPECT_DOUBLE_EQ(emflow::tools::fma_peak_work(1, 3000), 3.0 * once);
  EXPECT_STRNE(emflow::tools::compiled_instruction_set(), "");
}

}  // namespace
