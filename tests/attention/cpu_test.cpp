// What only the CPU backend promises: its result does not depend on the thread count, and its
// double path is the reference itself.
#include <gtest/gtest.h>

#include <vector>

#include "common/testing.hpp"
#include "emflow/attention.hpp"

namespace emflow::testing {
namespace {

// Every output is computed by one thread in a fixed order, so repeated runs and runs on any
// number of threads agree bit for bit.
TEST(CpuAttend, DeterministicAcrossRunsAndThreadCounts) {
  Problem p = Problem::random(2, 515, 40, 3, 8);
  p.mask = Mask::causal();
  p.key_bias = p.offset = true;
  p.key_lengths = {515, 400};
  Buffers<float> first(p);
  attend(first.input, first.output, {Device::cpu, 2});
  ASSERT_TRUE(all_finite_or_neg_inf(first.update));
  for (const int threads : {2, 1, 3, 0}) {
    Buffers<float> again(p);
    attend(again.input, again.output, {Device::cpu, threads});
    EXPECT_EQ(again.update, first.update) << threads << " threads";
    EXPECT_EQ(again.lse, first.lse) << threads << " threads";
    EXPECT_EQ(again.entropy, first.entropy) << threads << " threads";
  }
}

// Double inputs on the CPU device are computed by the reference: the same numbers exactly.
TEST(CpuAttend, DoubleInputsAreTheReference) {
  Problem p = Problem::random(2, 20, 6, 2, 3);
  p.mask = Mask::causal();
  p.key_bias = p.offset = true;
  Buffers<double> expected(p, true), actual(p, true);
  attend(expected.input, expected.output, {Device::reference});
  attend(actual.input, actual.output, {Device::cpu});
  EXPECT_EQ(actual.update, expected.update);
  EXPECT_EQ(actual.lse, expected.lse);
  EXPECT_EQ(actual.entropy, expected.entropy);
  EXPECT_EQ(actual.weights, expected.weights);
}

}  // namespace
}  // namespace emflow::testing
