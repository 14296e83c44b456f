// Non-finite input: find_non_finite / multi_index, and the documented policy (finite.hpp) that a
// non-finite cloud token reaches only the queries that can see it.
#include "emflow/finite.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "common/testing.hpp"
#include "emflow/attention.hpp"
#include "emflow/error.hpp"

namespace emflow {
namespace {

using emflow::testing::Buffers;
using emflow::testing::Problem;

template <class T>
class FindNonFinite : public ::testing::Test {};
TYPED_TEST_SUITE(FindNonFinite, emflow::testing::FloatTypes);

TYPED_TEST(FindNonFinite, NamesTheFirstNaNOrInfinity) {
  using T = TypeParam;
  std::vector<T> values(100);
  for (std::size_t i = 0; i < values.size(); ++i) values[i] = static_cast<T>(i) - T(50);
  EXPECT_EQ(find_non_finite(values.data(), 100), -1);
  values[99] = std::numeric_limits<T>::max();  // large but finite
  EXPECT_EQ(find_non_finite(values.data(), 100), -1);
  values[70] = -std::numeric_limits<T>::infinity();
  EXPECT_EQ(find_non_finite(values.data(), 100), 70);
  values[41] = std::numeric_limits<T>::quiet_NaN();
  EXPECT_EQ(find_non_finite(values.data(), 100), 41);
  EXPECT_EQ(find_non_finite(values.data(), 41), -1);  // only the first `count` are looked at
  values[0] = std::numeric_limits<T>::infinity();
  EXPECT_EQ(find_non_finite(values.data(), 100), 0);
  EXPECT_EQ(find_non_finite(values.data(), 0), -1);
  EXPECT_EQ(find_non_finite(static_cast<const T*>(nullptr), 0), -1);
}

TEST(MultiIndex, WritesTheRowMajorPosition) {
  EXPECT_EQ(multi_index({4}, 3), "[3]");
  EXPECT_EQ(multi_index({2, 7, 3}, 0), "[0, 0, 0]");
  EXPECT_EQ(multi_index({2, 7, 3}, 1 * 21 + 5 * 3 + 2), "[1, 5, 2]");
  EXPECT_EQ(multi_index({2, 7, 3}, 41), "[1, 6, 2]");
  EXPECT_EQ(multi_index({3, 1, 1, 5}, 14), "[2, 0, 0, 4]");
  EXPECT_THROW(multi_index({2, 7, 3}, 42), Error);
  EXPECT_THROW(multi_index({2, 7, 3}, -1), Error);
}

// The policy: run a causal problem twice, once with token j of cloud 0 replaced by NaN (or
// +Inf). Queries i < j of that cloud never see key j, so their outputs must be finite and equal
// to the clean run; so must every output of the other cloud. Queries i >= j see the token (what
// they get is the NaN rule, tested in nan_semantics_test.cpp). The reference must reproduce the
// clean run bit for bit; the CPU backend computes a cloud holding a visible non-finite token with
// the reference (so that NaNs land exactly where the reference puts them), so against its own
// clean run it agrees to float rounding.
template <class T>
void expect_token_reaches_only_its_viewers(Device device, T poison, std::int64_t j) {
  Problem p = Problem::random(2, 70, 6, 2, 21);
  p.key_bias = p.offset = true;
  p.mask = Mask::causal();
  ExecutionOptions options;
  options.device = device;
  options.threads = 2;

  Buffers<T> clean(p, /*with_weights=*/true);
  attend(clean.input, clean.output, options);
  Buffers<T> dirty(p, /*with_weights=*/true);
  const std::int64_t N = p.tokens, d = p.dim, H = p.heads;
  for (std::int64_t a = 0; a < d; ++a) dirty.cloud[static_cast<std::size_t>(j * d + a)] = poison;
  if (j + 1 < N) dirty.cloud[static_cast<std::size_t>((j + 1) * d)] = poison;  // partial token
  attend(dirty.input, dirty.output, options);

  const bool bitwise = device == Device::reference;
  auto same = [bitwise](T a, T b) {
    if (bitwise) return std::memcmp(&a, &b, sizeof(T)) == 0;
    if (a == b) return true;  // equal infinities included
    return std::isfinite(a) && std::abs(a - b) <= 1e-5 * (1.0 + std::abs(b));
  };
  for (std::int64_t b = 0; b < p.batch; ++b) {
    const std::int64_t seen_from = b == 0 ? j : N;  // the first query of cloud b that sees it
    for (std::int64_t i = 0; i < seen_from; ++i) {
      for (std::int64_t a = 0; a < d; ++a) {
        const auto at = static_cast<std::size_t>((b * N + i) * d + a);
        ASSERT_TRUE(std::isfinite(dirty.update[at])) << "cloud " << b << " query " << i;
        ASSERT_TRUE(same(dirty.update[at], clean.update[at]))
            << "cloud " << b << " query " << i << ": " << dirty.update[at] << " vs "
            << clean.update[at];
      }
      for (std::int64_t h = 0; h < H; ++h) {
        const auto row = static_cast<std::size_t>((b * H + h) * N + i);
        ASSERT_TRUE(same(dirty.lse[row], clean.lse[row])) << "lse, query " << i;
        ASSERT_TRUE(same(dirty.entropy[row], clean.entropy[row])) << "entropy, query " << i;
        for (std::int64_t k = 0; k < N; ++k) {
          const auto at = row * static_cast<std::size_t>(N) + static_cast<std::size_t>(k);
          ASSERT_TRUE(same(dirty.weights[at], clean.weights[at]))
              << "weight (" << i << ", " << k << ")";
        }
      }
    }
  }
}

// Key tiles are 32 wide and query blocks up to 64 tall: these positions are the first, inner and
// last of a tile and of a block.
const std::int64_t kPositions[] = {0, 5, 31, 32, 33, 63, 64, 69};

// NaN and +Inf, in float and in double, at every position of kPositions.
void expect_every_poison_reaches_only_its_viewers(Device device) {
  for (std::int64_t j : kPositions) {
    SCOPED_TRACE(j);
    expect_token_reaches_only_its_viewers<double>(device, std::numeric_limits<double>::quiet_NaN(),
                                                  j);
    expect_token_reaches_only_its_viewers<double>(device, std::numeric_limits<double>::infinity(),
                                                  j);
    expect_token_reaches_only_its_viewers<float>(device, std::numeric_limits<float>::quiet_NaN(),
                                                 j);
    expect_token_reaches_only_its_viewers<float>(device, std::numeric_limits<float>::infinity(), j);
  }
}

TEST(NonFinitePolicy, NaNAndInfTokensReachOnlyTheQueriesThatSeeThemOnTheReference) {
  expect_every_poison_reaches_only_its_viewers(Device::reference);
}

TEST(NonFinitePolicy, NaNAndInfTokensReachOnlyTheQueriesThatSeeThemOnTheCpu) {
  expect_every_poison_reaches_only_its_viewers(Device::cpu);
}

// Key lengths hide tokens j >= L: a NaN there reaches no visible query at all.
void expect_hidden_padding_is_ignored(Device device, std::int64_t length) {
  Problem p = Problem::random(1, 40, 4, 1, 5);
  p.key_lengths = {length};
  ExecutionOptions options;
  options.device = device;
  Buffers<float> clean(p), dirty(p);
  attend(clean.input, clean.output, options);
  for (std::int64_t t = length; t < 40; ++t) {
    dirty.cloud[static_cast<std::size_t>(t * 4 + 1)] = std::numeric_limits<float>::quiet_NaN();
  }
  attend(dirty.input, dirty.output, options);
  EXPECT_EQ(std::memcmp(dirty.update.data(), clean.update.data(),
                        static_cast<std::size_t>(length) * 4 * sizeof(float)),
            0)
      << to_string(device) << ", length " << length;
}

TEST(NonFinitePolicy, HiddenPaddingTokensMayHoldNaN) {
  for (Device device : {Device::reference, Device::cpu}) {
    for (std::int64_t length : {1, 25, 32, 39}) expect_hidden_padding_is_ignored(device, length);
  }
}

}  // namespace
}  // namespace emflow
