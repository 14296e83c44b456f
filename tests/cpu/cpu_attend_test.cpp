// The fast CPU backend (float32) held against the double-precision reference at the sizes the
// GPU tests use, with every mask, key lengths, key bias, offset, several heads and clouds.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <ostream>
#include <string>
#include <vector>

#include "common/testing.hpp"
#include "emflow/attention.hpp"

namespace emflow {
namespace {

using testing::all_finite_or_neg_inf;
using testing::Buffers;
using testing::Problem;
using testing::relative_error;

constexpr double kTolerance = 1e-5;  // fp32 against the fp64 reference (REFERENCE.md §6)

/// Key lengths of a case: none given, every cloud full, or a mix with an empty cloud.
enum class Lengths { none, full, mixed };

struct Case {
  std::int64_t batch, tokens, dim, heads;
  Mask mask;
  Lengths lengths = Lengths::none;
  bool key_bias = false, offset = false;
  double beta = 1.0;
};

std::ostream& operator<<(std::ostream& os, const Case& c) {
  const char* lengths[] = {"none", "full", "mixed"};
  return os << "B=" << c.batch << " N=" << c.tokens << " d=" << c.dim << " H=" << c.heads
            << " mask=" << to_string(c.mask) << " lengths=" << lengths[static_cast<int>(c.lengths)]
            << " bias=" << c.key_bias << " offset=" << c.offset << " beta=" << c.beta;
}

Problem make_problem(const Case& c, std::uint64_t seed) {
  Problem p = Problem::random(c.batch, c.tokens, c.dim, c.heads, seed);
  p.mask = c.mask;
  p.key_bias = c.key_bias;
  p.offset = c.offset;
  p.beta = c.beta;
  if (c.lengths == Lengths::full) p.key_lengths.assign(static_cast<std::size_t>(c.batch), c.tokens);
  if (c.lengths == Lengths::mixed) {
    // Cloud 0 keeps about two thirds of its keys, cloud 1 none at all, the rest all of them.
    for (std::int64_t b = 0; b < c.batch; ++b) {
      p.key_lengths.push_back(b == 0 ? (2 * c.tokens + 2) / 3 : b == 1 ? 0 : c.tokens);
    }
  }
  return p;
}

class CpuMatchesReference : public ::testing::TestWithParam<Case> {};

TEST_P(CpuMatchesReference, UpdateLseAndEntropy) {
  const Case c = GetParam();
  const Problem p = make_problem(c, 1000 + static_cast<std::uint64_t>(c.tokens * 7 + c.dim));
  Buffers<double> expected(p);
  attend(expected.input, expected.output, {Device::reference});
  Buffers<float> actual(p);
  attend(actual.input, actual.output, {Device::cpu, 2});

  ASSERT_TRUE(all_finite_or_neg_inf(actual.update));
  ASSERT_TRUE(all_finite_or_neg_inf(actual.lse));
  ASSERT_TRUE(all_finite_or_neg_inf(actual.entropy));
  // Guard against a vacuous pass: the reference update is not all zero.
  double norm = 0.0;
  for (double v : expected.update) norm += v * v;
  ASSERT_GT(norm, 0.0);

  EXPECT_LT(relative_error(actual.update, expected.update), kTolerance);
  EXPECT_LT(relative_error(actual.lse, expected.lse), kTolerance);
  EXPECT_LT(relative_error(actual.entropy, expected.entropy), kTolerance);
  // Queries without a visible key: exactly 0, -inf and 0, as in the reference.
  for (std::size_t i = 0; i < expected.lse.size(); ++i) {
    if (std::isinf(expected.lse[i])) {
      EXPECT_EQ(actual.lse[i], -std::numeric_limits<float>::infinity()) << "row " << i;
      EXPECT_EQ(actual.entropy[i], 0.0f) << "row " << i;
    }
  }
}

std::vector<Case> sizes_and_masks() {
  std::vector<Case> cases;
  const Mask masks[] = {Mask::none(), Mask::causal(), Mask::sliding_window(5)};
  for (std::int64_t n : {1, 7, 33, 101}) {
    for (std::int64_t d : {1, 3, 64}) {
      for (const Mask& m : masks) cases.push_back({1, n, d, 1, m});
    }
  }
  for (std::int64_t d : {128, 255}) {
    for (std::int64_t n : {7, 101}) {
      cases.push_back({1, n, d, 1, Mask::none()});
      cases.push_back({1, n, d, 2, Mask::causal(), Lengths::none, true, true});
    }
  }
  // Larger clouds: several key tiles and query blocks per cloud.
  cases.push_back({1, 1000, 64, 1, Mask::none()});
  cases.push_back({1, 1000, 128, 1, Mask::causal(), Lengths::none, true, false});
  cases.push_back({1, 1000, 255, 1, Mask::sliding_window(300), Lengths::none, false, true});
  cases.push_back({1, 4097, 3, 1, Mask::causal()});
  return cases;
}

std::vector<Case> layers_and_lengths() {
  std::vector<Case> cases;
  for (const Mask& m : {Mask::none(), Mask::causal(), Mask::sliding_window(17)}) {
    cases.push_back({3, 101, 33, 3, m, Lengths::mixed, true, true});
    cases.push_back({2, 70, 16, 4, m, Lengths::full, false, true, 0.5});
  }
  cases.push_back({4, 33, 64, 2, Mask::none(), Lengths::mixed, true, false, 2.0});
  cases.push_back({2, 1, 3, 3, Mask::none(), Lengths::mixed, true, true});
  cases.push_back({3, 300, 64, 2, Mask::sliding_window(1), Lengths::mixed, true, true});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Sizes, CpuMatchesReference, ::testing::ValuesIn(sizes_and_masks()));
INSTANTIATE_TEST_SUITE_P(Layers, CpuMatchesReference, ::testing::ValuesIn(layers_and_lengths()));

// A cloud whose key length is 0: every query is padding.
TEST(CpuAttend, CloudWithoutKeysGivesZeroUpdateAndMinusInfinity) {
  Problem p = Problem::random(2, 9, 5, 2, 5);
  p.offset = true;
  p.key_lengths = {0, 9};
  Buffers<float> buf(p);
  attend(buf.input, buf.output, {Device::cpu});
  for (std::int64_t i = 0; i < 9 * 5; ++i) EXPECT_EQ(buf.update[static_cast<std::size_t>(i)], 0.0f);
  for (std::int64_t i = 0; i < 2 * 9; ++i) {  // cloud 0, both heads
    EXPECT_EQ(buf.lse[static_cast<std::size_t>(i)], -std::numeric_limits<float>::infinity());
    EXPECT_EQ(buf.entropy[static_cast<std::size_t>(i)], 0.0f);
  }
  for (std::size_t i = 9 * 5; i < buf.update.size(); ++i) EXPECT_TRUE(std::isfinite(buf.update[i]));
  for (std::size_t i = 2 * 9; i < buf.lse.size(); ++i) EXPECT_TRUE(std::isfinite(buf.lse[i]));
}

// Requested weights: every row of P, including zeros where masked.
TEST(CpuAttend, WeightsMatchReference) {
  for (const Mask& m : {Mask::none(), Mask::causal(), Mask::sliding_window(9)}) {
    Problem p = Problem::random(2, 45, 7, 2, 21);
    p.mask = m;
    p.key_bias = true;
    p.key_lengths = {30, 45};
    Buffers<double> expected(p, true);
    attend(expected.input, expected.output, {Device::reference});
    Buffers<float> actual(p, true);
    attend(actual.input, actual.output, {Device::cpu});
    ASSERT_TRUE(all_finite_or_neg_inf(actual.weights));
    EXPECT_LT(relative_error(actual.weights, expected.weights), kTolerance) << to_string(m);
    EXPECT_LT(relative_error(actual.update, expected.update), kTolerance) << to_string(m);
    for (std::size_t i = 0; i < expected.weights.size(); ++i) {
      if (expected.weights[i] == 0.0) {
        ASSERT_EQ(actual.weights[i], 0.0f) << "entry " << i;
      }
    }
  }
}

// Every output is computed by one thread in a fixed order, so repeated runs and runs with
// different thread counts agree bit for bit.
TEST(CpuAttend, DeterministicAcrossRunsAndThreadCounts) {
  Problem p = Problem::random(2, 515, 40, 3, 8);
  p.mask = Mask::causal();
  p.key_bias = p.offset = true;
  p.key_lengths = {515, 400};
  Buffers<float> first(p), second(p), single(p);
  attend(first.input, first.output, {Device::cpu, 2});
  attend(second.input, second.output, {Device::cpu, 2});
  attend(single.input, single.output, {Device::cpu, 1});
  ASSERT_TRUE(all_finite_or_neg_inf(first.update));
  EXPECT_EQ(first.update, second.update);
  EXPECT_EQ(first.lse, second.lse);
  EXPECT_EQ(first.entropy, second.entropy);
  EXPECT_EQ(first.update, single.update);
  EXPECT_EQ(first.lse, single.lse);
  EXPECT_EQ(first.entropy, single.entropy);
}

// Large scores (beta = 30): the running max keeps every exponent <= 0, nothing overflows.
TEST(CpuAttend, SharpSoftmaxStaysFinite) {
  Problem p = Problem::random(1, 200, 16, 1, 4, 8.0);
  p.beta = 30.0;
  Buffers<double> expected(p);
  attend(expected.input, expected.output, {Device::reference});
  Buffers<float> actual(p);
  attend(actual.input, actual.output, {Device::cpu});
  ASSERT_TRUE(all_finite_or_neg_inf(actual.update));
  EXPECT_LT(relative_error(actual.update, expected.update), 1e-4);
  EXPECT_LT(relative_error(actual.lse, expected.lse), kTolerance);
}

// Padding past the key length may hold anything (here NaN and inf): it never reaches a result.
TEST(CpuAttend, PaddingPastKeyLengthIsNeverRead) {
  for (const Mask& m : {Mask::none(), Mask::causal(), Mask::sliding_window(6)}) {
    Problem p = Problem::random(2, 50, 8, 2, 17);
    p.mask = m;
    p.key_lengths = {37, 50};
    Buffers<double> expected(p);
    attend(expected.input, expected.output, {Device::reference});
    for (std::int64_t i = 37; i < 50; ++i) {
      for (std::int64_t a = 0; a < 8; ++a) {
        p.cloud[static_cast<std::size_t>(i * 8 + a)] =
            a % 2 ? std::numeric_limits<double>::quiet_NaN()
                  : std::numeric_limits<double>::infinity();
      }
    }
    Buffers<float> actual(p);
    attend(actual.input, actual.output, {Device::cpu});
    ASSERT_TRUE(all_finite_or_neg_inf(actual.update)) << to_string(m);
    EXPECT_LT(relative_error(actual.update, expected.update), kTolerance) << to_string(m);
    EXPECT_LT(relative_error(actual.lse, expected.lse), kTolerance) << to_string(m);
  }
}

// A non-finite visible token reaches exactly the queries that see it, as in the reference.
TEST(CpuAttend, NonFiniteTokenReachesTheQueriesThatSeeIt) {
  Problem p = Problem::random(1, 40, 4, 1, 9);
  p.mask = Mask::causal();
  p.cloud[20 * 4 + 1] = std::numeric_limits<double>::quiet_NaN();
  Buffers<double> expected(p);
  attend(expected.input, expected.output, {Device::reference});
  Buffers<float> actual(p);
  attend(actual.input, actual.output, {Device::cpu});
  for (std::size_t i = 0; i < expected.update.size(); ++i) {
    ASSERT_EQ(std::isnan(actual.update[i]), std::isnan(expected.update[i])) << "entry " << i;
  }
  EXPECT_FALSE(std::isnan(actual.update[19 * 4]));  // query 19 does not see token 20
}

// Double inputs on the CPU device are computed by the reference.
TEST(CpuAttend, DoubleInputsMatchTheReference) {
  Problem p = Problem::random(2, 20, 6, 2, 3);
  p.mask = Mask::causal();
  Buffers<double> expected(p), actual(p);
  attend(expected.input, expected.output, {Device::reference});
  attend(actual.input, actual.output, {Device::cpu});
  EXPECT_LT(relative_error(actual.update, expected.update), 1e-14);
}

}  // namespace
}  // namespace emflow
