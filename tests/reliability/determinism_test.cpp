// Determinism of the fast CPU backend: for identical input and thread count, every output is
// bitwise identical run to run (each output element is computed by one thread in a fixed order,
// see src/cpu/engine.hpp), and, as the engine also promises, across thread counts.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "common/testing.hpp"
#include "emflow/attention.hpp"

namespace emflow {
namespace {

using emflow::testing::Buffers;
using emflow::testing::Problem;

struct Outputs {
  std::vector<float> update, lse, entropy, weights;
};

Outputs run(const Problem& p, int threads) {
  Buffers<float> buffers(p, /*with_weights=*/true);
  ExecutionOptions options;
  options.device = Device::cpu;
  options.threads = threads;
  attend(buffers.input, buffers.output, options);
  return {buffers.update, buffers.lse, buffers.entropy, buffers.weights};
}

::testing::AssertionResult bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << "sizes differ";
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0) {
      return ::testing::AssertionFailure()
             << "element " << i << " differs: " << a[i] << " vs " << b[i];
    }
  }
  return ::testing::AssertionSuccess();
}

void expect_same(const Outputs& a, const Outputs& b) {
  EXPECT_TRUE(bitwise_equal(a.update, b.update)) << "update";
  EXPECT_TRUE(bitwise_equal(a.lse, b.lse)) << "lse";
  EXPECT_TRUE(bitwise_equal(a.entropy, b.entropy)) << "entropy";
  EXPECT_TRUE(bitwise_equal(a.weights, b.weights)) << "weights";
}

std::vector<Problem> problems() {
  std::vector<Problem> out;
  Problem dense = Problem::random(3, 150, 24, 3, 101);
  dense.key_bias = dense.offset = true;
  out.push_back(dense);
  Problem causal = Problem::random(2, 200, 16, 2, 102);
  causal.mask = Mask::causal();
  causal.key_lengths = {200, 77};
  out.push_back(causal);
  Problem window = Problem::random(1, 129, 9, 4, 103);
  window.mask = Mask::sliding_window(40);
  window.offset = true;
  out.push_back(window);
  return out;
}

TEST(Determinism, CpuOutputsAreBitwiseIdenticalRunToRun) {
  for (const Problem& p : problems()) {
    for (int threads : {1, 2, 3}) {
      SCOPED_TRACE(::testing::Message() << "N = " << p.tokens << ", threads = " << threads);
      const Outputs first = run(p, threads);
      // The outputs are real numbers, not an untouched poison or zero fill.
      ASSERT_TRUE(emflow::testing::all_finite_or_neg_inf(first.update));
      ASSERT_TRUE(emflow::testing::all_finite_or_neg_inf(first.weights));
      for (int repeat = 0; repeat < 3; ++repeat) expect_same(run(p, threads), first);
    }
  }
}

TEST(Determinism, CpuOutputsDoNotDependOnTheThreadCount) {
  for (const Problem& p : problems()) {
    SCOPED_TRACE(::testing::Message() << "N = " << p.tokens);
    const Outputs one = run(p, 1);
    expect_same(run(p, 2), one);
    expect_same(run(p, 4), one);
  }
}

}  // namespace
}  // namespace emflow
