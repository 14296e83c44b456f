// Helpers for the reference tests: seeded layers, emflow::attend on tensors, and an element-wise
// comparison that names the first mismatching index (random tensors: common/testing.hpp).
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "common/testing.hpp"
#include "emflow/attention.hpp"
#include "emflow/error.hpp"
#include "emflow/reference.hpp"
#include "emflow/tensor.hpp"

namespace emflow::testing {

/// A layer of `heads` heads in R^dim with entries of M and F scaled by `scale` / sqrt(dim), so
/// scores of unit-sized tokens are O(scale) and the softmax is far from flat.
inline reference::Layer random_layer(std::int64_t heads, std::int64_t dim, std::uint64_t seed,
                                     bool key_bias, bool offset, double scale = 2.0) {
  const double s = scale / std::sqrt(static_cast<double>(dim));
  reference::Layer layer;
  layer.relevance = random_tensor({heads, dim, dim}, seed * 11 + 1, -s, s);
  layer.content = random_tensor({heads, dim, dim}, seed * 11 + 2, -s, s);
  if (key_bias) layer.key_bias = random_tensor({heads, dim}, seed * 11 + 3);
  if (offset) layer.offset = random_tensor({dim}, seed * 11 + 4);
  return layer;
}

/// emflow::attend on Device::reference for tensors, outputs poisoned with NaN before the call.
inline reference::Attention attend_via_api(const Tensor<double>& cloud,
                                           const reference::Layer& layer, double beta,
                                           const Mask& mask,
                                           const std::vector<std::int64_t>& key_lengths,
                                           bool with_weights = false) {
  const std::int64_t B = cloud.rank() == 3 ? cloud.extent(0) : 1;
  const std::int64_t N = cloud.extent(cloud.rank() - 2), d = cloud.extent(cloud.rank() - 1);
  const std::int64_t H = layer.heads();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  reference::Attention out;
  out.update = Tensor<double>(cloud.shape(), std::vector<double>(cloud.values().size(), nan));
  out.lse = Tensor<double>({B, H, N}, std::vector<double>(B * H * N, nan));
  out.entropy = Tensor<double>({B, H, N}, std::vector<double>(B * H * N, nan));
  if (with_weights)
    out.weights = Tensor<double>({B, H, N, N}, std::vector<double>(B * H * N * N, nan));

  AttentionInput<double> input;
  input.cloud = cloud.data();
  input.batch = B;
  input.tokens = N;
  input.dim = d;
  input.layer = layer.operators();
  input.beta = beta;
  input.mask = mask;
  input.key_lengths = key_lengths.empty() ? nullptr : key_lengths.data();
  AttentionOutput<double> output;
  output.update = out.update.data();
  output.lse = out.lse.data();
  output.entropy = out.entropy.data();
  output.weights = with_weights ? out.weights.data() : nullptr;
  attend(input, output, {Device::reference});
  return out;
}

/// |a_e - b_e| <= tolerance * max(1, |b_e|) for every element e, equal infinities counting as
/// equal; shapes must agree. On failure names the first offending element and both values.
inline ::testing::AssertionResult tensors_near(const Tensor<double>& a, const Tensor<double>& b,
                                               double tolerance) {
  if (a.shape() != b.shape()) {
    return ::testing::AssertionFailure()
           << "shapes differ: " << to_string(a.shape()) << " vs " << to_string(b.shape());
  }
  for (std::int64_t e = 0; e < a.size(); ++e) {
    const double x = a[e], y = b[e];
    if (std::isinf(x) && std::isinf(y) && x == y) continue;
    if (!(std::abs(x - y) <= tolerance * std::max(1.0, std::abs(y)))) {
      return ::testing::AssertionFailure()
             << "element " << e << " of " << to_string(a.shape()) << ": " << x << " vs " << y
             << " (tolerance " << tolerance << ")";
    }
  }
  return ::testing::AssertionSuccess();
}

/// The largest |x| over a tensor: guards against comparisons that pass on all-zero outputs.
inline double max_abs(const Tensor<double>& t) {
  double m = 0.0;
  for (double x : t.values()) m = std::max(m, std::abs(x));
  return m;
}

/// Runs `call`, expects emflow::Error with ErrorCode::invalid_argument whose message contains
/// `'argument'` and every string of `fragments`.
template <class Call>
::testing::AssertionResult rejects(Call&& call, const std::string& argument,
                                   std::vector<std::string> fragments = {}) {
  fragments.insert(fragments.begin(), "'" + argument + "'");
  return throws_error(std::forward<Call>(call), ErrorCode::invalid_argument, fragments);
}

}  // namespace emflow::testing
