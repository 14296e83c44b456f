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
using FloatTypes = ::testing::Types<float, double>;
TYPED_TEST_SUITE(FindNonFinite, FloatTypes);

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
// +Inf). Queries i < j of that cloud never see key j, so their outputs must be finite and
// bitwise equal to the clean run; so must every output of the other cloud. Queries i >= j see
// the token and their outputs are unspecified. `unaffected` is the number of leading queries of
// cloud 0 checked (j for the full policy).
template <class T>
void expect_token_reaches_only_its_viewers(Device device, T poison, std::int64_t j,
                                           std::int64_t unaffected) {
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

  auto same = [](T a, T b) { return std::memcmp(&a, &b, sizeof(T)) == 0; };
  for (std::int64_t b = 0; b < p.batch; ++b) {
    const std::int64_t seen_from = b == 0 ? unaffected : N;
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

TEST(NonFinitePolicy, NaNAndInfTokensReachOnlyTheQueriesThatSeeThemOnTheReference) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  for (std::int64_t j : {0, 5, 31, 32, 33, 64, 69}) {
    SCOPED_TRACE(j);
    expect_token_reaches_only_its_viewers<double>(Device::reference, nan, j, j);
    expect_token_reaches_only_its_viewers<double>(Device::reference, inf, j, j);
    expect_token_reaches_only_its_viewers<float>(Device::reference, static_cast<float>(nan), j, j);
  }
}

// Key tiles are 32 wide and query blocks up to 64 tall: these positions are the first, inner and
// last of a tile and of a block.
const std::int64_t kCpuPositions[] = {0, 5, 31, 32, 33, 63, 64, 69};

// Today's fast CPU backend keeps a non-finite token out of every query before the 32-key tile
// that holds it (and out of every other cloud) ...
TEST(NonFinitePolicy, NaNAndInfTokensStayOutOfEarlierKeyTilesOnTheCpu) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  for (std::int64_t j : kCpuPositions) {
    SCOPED_TRACE(j);
    const std::int64_t tile_start = j / 32 * 32;
    expect_token_reaches_only_its_viewers<float>(Device::cpu, nan, j, tile_start);
    expect_token_reaches_only_its_viewers<float>(Device::cpu, inf, j, tile_start);
    expect_token_reaches_only_its_viewers<double>(Device::cpu, static_cast<double>(nan), j, j);
  }
}

// ... but not yet out of the earlier queries of its own tile: the content product O += P V runs
// over whole 32-key tiles, and a masked key's weight 0 times its NaN value is NaN. Enable this
// test when the engine skips masked keys in partial tiles (docs/RELIABILITY.md, known defects).
TEST(NonFinitePolicy, DISABLED_NaNAndInfTokensReachOnlyTheQueriesThatSeeThemOnTheCpu) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  for (std::int64_t j : kCpuPositions) {
    SCOPED_TRACE(j);
    expect_token_reaches_only_its_viewers<float>(Device::cpu, nan, j, j);
    expect_token_reaches_only_its_viewers<float>(Device::cpu, inf, j, j);
  }
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
  for (std::int64_t length : {1, 25, 32, 39}) {
    expect_hidden_padding_is_ignored(Device::reference, length);
  }
  expect_hidden_padding_is_ignored(Device::cpu, 32);  // padding starts a fresh key tile
}

// The same defect as above: padding keys inside the last partial key tile leak NaN.
TEST(NonFinitePolicy, DISABLED_HiddenPaddingTokensMayHoldNaNOnTheCpu) {
  for (std::int64_t length : {1, 25, 39}) expect_hidden_padding_is_ignored(Device::cpu, length);
}

}  // namespace
}  // namespace emflow
