// The NaN rule of docs/MATH.md §6.6 on the CUDA device, both algorithms (float without weights:
// the fused kernel; float with weights and double: the unfused path with its row softmax), and
// the float bound on beta. The GPU tests skip without a device; tests/cuda/emulation runs them
// on the CPU. The cases keep to the rule's part that the GPU paths promise: a non-finite token
// that a mask hides from some real queries may still reach them there (docs/RELIABILITY.md §5),
// so every poisoned token here is seen by every real query of its cloud.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "common/nan_expectations.hpp"
#include "common/testing.hpp"
#include "emflow/attention.hpp"
#include "emflow/error.hpp"

#if defined(EMFLOW_WITH_CUDA)
#include "emflow/cuda.hpp"
#endif

namespace emflow::testing {
namespace {

/// NaN of the element type of `values`.
template <class V>
typename V::value_type nan_of(const V&) {
  return std::numeric_limits<typename V::value_type>::quiet_NaN();
}

// Fused (float, no weights), unfused in float (weights requested) and unfused in double.
template <class Poison>
void on_every_gpu_path(const Problem& p, const Poison& poison, const NaNReach& reach,
                       const std::string& what) {
  expect_nan_reach<float>(
      p, [&](Buffers<float>& b) { poison(b); }, reach, Device::cuda, false, false,
      what + " (fused)");
  expect_nan_reach<float>(
      p, [&](Buffers<float>& b) { poison(b); }, reach, Device::cuda, true, false,
      what + " (unfused)");
  expect_nan_reach<double>(
      p, [&](Buffers<double>& b) { poison(b); }, reach, Device::cuda, true, false,
      what + " (unfused, double)");
}

// No mask, key lengths {4, 5}, 2 heads: a NaN in token 2 of cloud 0 (its score and its query
// row) reaches every real query of cloud 0, every head; the padding query 4 stays 0 / -inf / 0
// and cloud 1 is untouched. Causal: token 0 is seen by every query, and query 0 sees nothing
// but its NaN score.
TEST(CudaNaN, NaNTokenSeenByItsCloudGivesNaNNotAnEmptyRow) {
  EMFLOW_REQUIRE_CUDA();
  const NaNReach cloud0{[](std::int64_t b, std::int64_t, std::int64_t) { return b == 0; },
                        [](std::int64_t b, std::int64_t) { return b == 0; }};
  Problem p = Problem::random(2, 5, 3, 2, 13);
  p.key_bias = p.offset = true;
  p.key_lengths = {4, 5};
  on_every_gpu_path(
      p, [](auto& b) { b.cloud[2 * 3 + 1] = nan_of(b.cloud); }, cloud0, "NaN in token 2, no mask");
  p.mask = Mask::causal();
  p.key_lengths.clear();
  on_every_gpu_path(
      p, [](auto& b) { b.cloud[0] = nan_of(b.cloud); }, cloud0, "NaN in token 0, causal");
}

// A NaN in M_1 or u_1 makes head 1's statistics and every real query's update NaN, head 0's
// statistics stay; a NaN column of F_1 or a NaN offset reach the update only. Cloud 1 has key
// length 3: its padding queries stay 0 / -inf / 0.
TEST(CudaNaN, NaNOperatorReachesEveryRealQuery) {
  EMFLOW_REQUIRE_CUDA();
  Problem p = Problem::random(2, 5, 3, 2, 17);
  p.mask = Mask::causal();
  p.key_bias = p.offset = true;
  p.key_lengths = {5, 3};
  const NaNReach head1{[](std::int64_t, std::int64_t h, std::int64_t) { return h == 1; },
                       [](std::int64_t, std::int64_t) { return true; }};
  const NaNReach update{[](std::int64_t, std::int64_t, std::int64_t) { return false; },
                        [](std::int64_t, std::int64_t) { return true; }};
  on_every_gpu_path(
      p, [](auto& b) { b.relevance[9 + 4] = nan_of(b.relevance); }, head1, "NaN in M_1");
  on_every_gpu_path(
      p, [](auto& b) { b.bias[3 + 2] = nan_of(b.bias); }, head1, "NaN in u_1");
  on_every_gpu_path(
      p,
      [](auto& b) {
        for (std::size_t a = 0; a < 3; ++a) b.content[9 + a * 3 + 1] = nan_of(b.content);
      },
      update, "NaN column of F_1");
  on_every_gpu_path(
      p, [](auto& b) { std::fill(b.shift.begin(), b.shift.end(), nan_of(b.shift)); }, update,
      "NaN offset");
}

// beta = 2^64, the largest a float call accepts: a hard maximum, on both algorithms as on the
// reference.
TEST(CudaNaN, FloatBetaAtTheBoundAgreesWithTheReference) {
  EMFLOW_REQUIRE_CUDA();
  Problem p = Problem::random(1, 37, 5, 2, 8);
  p.mask = Mask::causal();
  p.key_bias = p.offset = true;
  p.beta = 18446744073709551616.0;
  Buffers<double> expected(p, true);
  attend(expected.input, expected.output, {Device::reference});
  for (const bool weights : {false, true}) {
    SCOPED_TRACE(weights ? "unfused" : "fused");
    Buffers<float> actual(p, weights);
    attend(actual.input, actual.output, {Device::cuda});
    ASSERT_NO_FATAL_FAILURE(expect_agrees_at_beta_bound(actual, expected));
  }
}

// The stream-ordered API applies the same bound (no device needed to be refused).
TEST(CudaNaN, FloatBetaBeyondTheBoundIsRefusedByTheAsyncApi) {
#if defined(EMFLOW_WITH_CUDA)
  Problem p = Problem::random(1, 5, 3, 1, 2);
  for (const double beta : {1e38, 1e39}) {
    p.beta = beta;
    Buffers<float> b(p);
    try {
      (void)cuda::attend_workspace_size(b.input, b.output);
      FAIL() << "beta " << beta << " was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
      EXPECT_NE(std::string(e.what()).find("'beta'"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("2^64"), std::string::npos) << e.what();
    }
  }
  p.beta = 1e39;  // double input: any finite beta
  Buffers<double> d(p);
  EXPECT_GT(cuda::attend_workspace_size(d.input, d.output), 0u);
#else
  GTEST_SKIP() << "built without CUDA";
#endif
}

}  // namespace
}  // namespace emflow::testing
