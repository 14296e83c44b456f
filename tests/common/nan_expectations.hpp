// The NaN rule of docs/MATH.md §6.6 as a check every backend's test applies: run a clean
// problem and a poisoned copy on one device, then each output is either NaN (where the rule puts
// the poison), exactly what a padding query gets, or what the clean run gives.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "common/testing.hpp"
#include "emflow/attention.hpp"

namespace emflow::testing {

/// Which outputs the poison must reach: the (cloud, head, query) rows whose lse and entropy
/// become NaN, and the (cloud, query) rows whose update becomes NaN.
struct NaNReach {
  std::function<bool(std::int64_t b, std::int64_t h, std::int64_t i)> stats;
  std::function<bool(std::int64_t b, std::int64_t i)> update;
};

/// Runs `p` clean and poisoned by `poison` on `device` and checks the rule. `exact`: outputs
/// the poison does not reach must equal the clean run bit for bit (else to 1e-5 relative).
/// `weights` also requests and checks the weights (on the CUDA device: the unfused algorithm).
/// Outputs are preset to 777 so that a NaN must have been written, not left over.
template <class T>
void expect_nan_reach(const Problem& p, const std::function<void(Buffers<T>&)>& poison,
                      const NaNReach& reach, Device device, bool weights, bool exact,
                      const std::string& what) {
  SCOPED_TRACE(what + " on " + to_string(device) + (weights ? " with weights" : ""));
  ExecutionOptions options;
  options.device = device;
  options.threads = 2;
  Buffers<T> clean(p, weights), dirty(p, weights);
  attend(clean.input, clean.output, options);
  ASSERT_TRUE(all_finite_or_neg_inf(clean.update));
  ASSERT_TRUE(all_finite_or_neg_inf(clean.lse));
  poison(dirty);
  for (auto* v : {&dirty.update, &dirty.lse, &dirty.entropy, &dirty.weights}) {
    std::fill(v->begin(), v->end(), T(777));
  }
  attend(dirty.input, dirty.output, options);

  auto same = [exact](T a, T b) {
    if (exact) return std::memcmp(&a, &b, sizeof(T)) == 0;
    if (a == b) return true;
    return std::isfinite(a) && std::abs(a - b) <= 1e-5 * (1.0 + std::abs(b));
  };
  const std::int64_t N = p.tokens, d = p.dim, H = p.heads;
  for (std::int64_t b = 0; b < p.batch; ++b) {
    const std::int64_t length = p.key_lengths.empty() ? N : p.key_lengths[std::size_t(b)];
    for (std::int64_t i = 0; i < N; ++i) {
      const bool padding = i >= length;
      const bool hit = !padding && reach.update(b, i);
      for (std::int64_t a = 0; a < d; ++a) {
        const auto at = static_cast<std::size_t>((b * N + i) * d + a);
        const T got = dirty.update[at];
        if (padding) {
          ASSERT_EQ(got, T(0)) << "padding query " << i << " of cloud " << b;
        } else if (hit) {
          ASSERT_TRUE(std::isnan(got)) << "update of query " << i << " of cloud " << b << "[" << a
                                       << "] is " << got << ", not NaN";
        } else {
          ASSERT_TRUE(same(got, clean.update[at])) << "update of query " << i << " of cloud " << b
                                                   << ": " << got << " vs " << clean.update[at];
        }
      }
      const KeyRange keys = p.mask.visible_keys(i, length);
      for (std::int64_t h = 0; h < H; ++h) {
        const auto row = static_cast<std::size_t>((b * H + h) * N + i);
        const T lse = dirty.lse[row], entropy = dirty.entropy[row];
        const bool stat_hit = !padding && reach.stats(b, h, i);
        if (padding) {
          ASSERT_EQ(lse, -std::numeric_limits<T>::infinity()) << "padding query " << i;
          ASSERT_EQ(entropy, T(0)) << "padding query " << i;
        } else if (stat_hit) {
          ASSERT_TRUE(std::isnan(lse)) << "lse of head " << h << ", query " << i << " is " << lse;
          ASSERT_TRUE(std::isnan(entropy))
              << "entropy of head " << h << ", query " << i << " is " << entropy;
        } else {
          ASSERT_TRUE(same(lse, clean.lse[row])) << "lse of head " << h << ", query " << i;
          ASSERT_TRUE(same(entropy, clean.entropy[row]))
              << "entropy of head " << h << ", query " << i;
        }
        if (!weights) continue;
        for (std::int64_t j = 0; j < N; ++j) {
          const T w =
              dirty.weights[row * static_cast<std::size_t>(N) + static_cast<std::size_t>(j)];
          if (!keys.contains(j)) {
            ASSERT_EQ(w, T(0)) << "masked weight (" << i << ", " << j << ")";
          } else if (stat_hit) {
            ASSERT_TRUE(std::isnan(w)) << "weight (" << i << ", " << j << ") is " << w;
          } else {
            ASSERT_TRUE(same(
                w, clean.weights[row * static_cast<std::size_t>(N) + static_cast<std::size_t>(j)]))
                << "weight (" << i << ", " << j << ")";
          }
        }
      }
    }
  }
}

/// The checks of a float run `actual` at the largest beta a float call accepts against the double
/// reference `expected`: the softmax is a hard maximum and both find the same key.
inline void expect_agrees_at_beta_bound(const Buffers<float>& actual,
                                        const Buffers<double>& expected) {
  ASSERT_TRUE(all_finite_or_neg_inf(actual.update));
  EXPECT_LT(relative_error(actual.update, expected.update), 1e-5);
  EXPECT_LT(relative_error(actual.lse, expected.lse), 1e-5);
  EXPECT_LT(max_abs_difference(actual.entropy, expected.entropy), 1e-6);
}

}  // namespace emflow::testing
