// The NaN rule of docs/MATH.md §6.6 on the reference and the CPU device: a NaN reaches exactly
// the outputs the rule names (update, lse, entropy and weights of the queries that see it) and
// no other; and a float beta that would overflow the float scores is refused (§6.6).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/nan_expectations.hpp"
#include "common/testing.hpp"
#include "emflow/attention.hpp"
#include "emflow/error.hpp"
#include "emflow/factored.hpp"

namespace emflow::testing {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// Every backend of this suite, with whether the outputs the poison cannot reach must equal the
// clean run bit for bit: the reference always; the CPU device computes a cloud holding a
// non-finite token with the reference (and its clean run with the float engine), so for a NaN
// token only to float rounding, and NaN operators with the engine on both runs.
template <class T>
void on_every_cpu_backend(const Problem& p, const std::function<void(Buffers<T>&)>& poison,
                          const NaNReach& reach, bool token_poison, const std::string& what) {
  expect_nan_reach<T>(p, poison, reach, Device::reference, true, true, what);
  const bool exact = !std::is_same_v<T, float> || !token_poison;
  expect_nan_reach<T>(p, poison, reach, Device::cpu, true, exact, what);
  expect_nan_reach<T>(p, poison, reach, Device::cpu, false, exact, what);
}

// N = 5, d = 3, causal: one NaN coordinate of token 2 makes key 2's score NaN for the queries
// that see it (2, 3, 4) and query 2's own scores NaN (its query row is NaN). Queries 0 and 1 do
// not see key 2: bit for bit the clean outputs (to rounding on the CPU, see above).
template <class T>
void nan_key_under_causal_mask() {
  Problem p = Problem::random(1, 5, 3, 2, 3);
  p.mask = Mask::causal();
  p.key_bias = p.offset = true;
  const NaNReach reach{[](std::int64_t, std::int64_t, std::int64_t i) { return i >= 2; },
                       [](std::int64_t, std::int64_t i) { return i >= 2; }};
  on_every_cpu_backend<T>(
      p, [](Buffers<T>& b) { b.cloud[2 * 3 + 1] = static_cast<T>(kNaN); }, reach, true,
      "NaN in token 2");
}

TEST(NaNSemantics, NaNKeyReachesExactlyTheQueriesThatSeeItFloat) {
  nan_key_under_causal_mask<float>();
}
TEST(NaNSemantics, NaNKeyReachesExactlyTheQueriesThatSeeItDouble) {
  nan_key_under_causal_mask<double>();
}

// No mask, key lengths {4, 5}: a NaN visible token of cloud 0 reaches all of its real queries,
// none of its padding query 4 and nothing of cloud 1; a NaN padding token (4) reaches nobody.
TEST(NaNSemantics, NaNTokenReachesItsCloudButNotPaddingOrOtherClouds) {
  Problem p = Problem::random(2, 5, 3, 1, 5);
  p.key_lengths = {4, 5};
  p.offset = true;
  const NaNReach reach{[](std::int64_t b, std::int64_t, std::int64_t) { return b == 0; },
                       [](std::int64_t b, std::int64_t) { return b == 0; }};
  on_every_cpu_backend<float>(
      p,
      [](Buffers<float>& b) {
        b.cloud[2 * 3] = static_cast<float>(kNaN);
        for (int a = 0; a < 3; ++a) b.cloud[4 * 3 + a] = static_cast<float>(kNaN);
      },
      reach, true, "NaN in token 2 and in padding token 4");
  // Padding alone: nothing changes (the reach is empty).
  const NaNReach none{[](std::int64_t, std::int64_t, std::int64_t) { return false; },
                      [](std::int64_t, std::int64_t) { return false; }};
  on_every_cpu_backend<float>(
      p, [](Buffers<float>& b) { b.cloud[4 * 3 + 2] = static_cast<float>(kNaN); }, none, false,
      "NaN in padding token 4 only");
}

// A NaN in an operator of head 1: M_1 or u_1 make every score of head 1 NaN, so head 1's lse
// and entropy and every real query's update are NaN while head 0's statistics are untouched;
// a NaN column of F_1 or a NaN c reach the update only (every coordinate of it). Padding queries
// (cloud 1 has key length 3) stay 0 / -inf / 0. On the CPU device this is the float engine (finite
// clouds are not sent to the reference).
template <class T>
void nan_operator(Mask mask, std::int64_t tokens) {
  Problem p = Problem::random(2, tokens, 3, 2, 11);
  p.mask = mask;
  p.key_bias = p.offset = true;
  p.key_lengths = {tokens, 3};
  const std::size_t head1 = 9, head1_bias = 3;
  const NaNReach scores{[](std::int64_t, std::int64_t h, std::int64_t) { return h == 1; },
                        [](std::int64_t, std::int64_t) { return true; }};
  const NaNReach content{[](std::int64_t, std::int64_t, std::int64_t) { return false; },
                         [](std::int64_t, std::int64_t) { return true; }};
  const std::string where = to_string(mask) + ", N " + std::to_string(tokens);
  on_every_cpu_backend<T>(
      p, [&](Buffers<T>& b) { b.relevance[head1 + 4] = static_cast<T>(kNaN); }, scores, false,
      "NaN in M_1, " + where);
  on_every_cpu_backend<T>(
      p, [&](Buffers<T>& b) { b.bias[head1_bias + 2] = static_cast<T>(kNaN); }, scores, false,
      "NaN in u_1, " + where);
  on_every_cpu_backend<T>(
      p,
      [&](Buffers<T>& b) {
        for (std::size_t a = 0; a < 3; ++a) b.content[head1 + a * 3 + 1] = static_cast<T>(kNaN);
      },
      content, false, "NaN in column 1 of F_1, " + where);
  on_every_cpu_backend<T>(
      p, [&](Buffers<T>& b) { std::fill(b.shift.begin(), b.shift.end(), static_cast<T>(kNaN)); },
      content, false, "NaN offset c, " + where);
}

TEST(NaNSemantics, NaNOperatorReachesEveryQueryOfItsHead) {
  nan_operator<float>(Mask::causal(), 5);
  nan_operator<double>(Mask::causal(), 5);
  // Several key tiles and query blocks of the engine, and window rows that see nothing of a
  // tile before their first visible one.
  nan_operator<float>(Mask::none(), 70);
  nan_operator<float>(Mask::sliding_window(20), 70);
}

// A float beta whose product with scores of order 1 overflows float (1e38, 1e39 or any beyond
// 2^64) is refused before any backend runs, naming 'beta', the bound and the value.
void expect_beta_refused(const std::function<void()>& call, const std::string& value) {
  try {
    call();
    FAIL() << "beta " << value << " was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    const std::string message = e.what();
    EXPECT_NE(message.find("'beta'"), std::string::npos) << message;
    EXPECT_NE(message.find("2^64"), std::string::npos) << message;
    EXPECT_NE(message.find(value), std::string::npos) << message;
  }
}

TEST(FloatBeta, BeyondTheFloatBoundIsRefusedOnEveryBackend) {
  Problem p = Problem::random(1, 5, 3, 1, 2);
  p.mask = Mask::causal();
  for (const auto& [beta, text] : {std::pair{1e38, "1e+38"}, std::pair{1e39, "1e+39"},
                                   std::pair{-1e39, "-1e+39"}, std::pair{2e19, "2e+19"}}) {
    p.beta = beta;
    for (Device device : {Device::reference, Device::cpu, Device::cuda}) {
      Buffers<float> b(p);
      expect_beta_refused([&] { attend(b.input, b.output, {device}); }, text);
    }
    Buffers<float> b(p);
    FactoredLayer<float> layer{
        1,       3,      b.relevance.data(), b.relevance.data(), b.content.data(), b.content.data(),
        nullptr, nullptr};
    b.input.layer = {};
    expect_beta_refused([&] { attend_factored(b.input, layer, b.output, {Device::cpu}); }, text);
  }
}

// At the bound the float backends still agree with the reference: beta = 2^64 makes the softmax
// a hard maximum (weight 1 on the best key), and the float engine finds the same key, lse and
// entropy 0. A double call accepts any finite beta.
TEST(FloatBeta, AtTheBoundTheFloatEngineAgreesWithTheReference) {
  Problem p = Problem::random(2, 37, 5, 2, 8);
  p.mask = Mask::causal();
  p.key_bias = p.offset = true;
  p.beta = 18446744073709551616.0;
  Buffers<double> expected(p);
  attend(expected.input, expected.output, {Device::reference});
  Buffers<float> actual(p, true);
  attend(actual.input, actual.output, {Device::cpu});
  ASSERT_NO_FATAL_FAILURE(expect_agrees_at_beta_bound(actual, expected));
  EXPECT_GT(std::abs(expected.lse[5]), 1e18);  // the scores are of order beta

  p.beta = 1e39;
  Buffers<double> wide(p);
  attend(wide.input, wide.output, {Device::cpu});
  EXPECT_TRUE(all_finite_or_neg_inf(wide.update));
  EXPECT_LT(relative_error(wide.update, expected.update), 1e-12);  // the same hard maximum
}

}  // namespace
}  // namespace emflow::testing
