// Shared test helpers: seeded random problems, relative errors, NaN poisoning, device skips.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "emflow/attention.hpp"

namespace emflow::testing {

/// Deterministic values in [lo, hi) from `seed`.
std::vector<double> uniform(std::size_t count, std::uint64_t seed, double lo = -1.0,
                            double hi = 1.0);

/// A complete seeded attention problem, stored in double so it can be converted exactly to
/// float (values are rounded to float first, so float and double problems are identical).
struct Problem {
  std::int64_t batch = 1, tokens = 1, dim = 1, heads = 1;
  double beta = 1.0;
  Mask mask;
  bool key_bias = false, offset = false;
  std::vector<std::int64_t> key_lengths;  // empty: none
  std::vector<double> cloud, relevance, content, bias, shift;

  /// Random problem; operator entries scaled by `scale` / sqrt(dim) so softmax is not flat.
  static Problem random(std::int64_t batch, std::int64_t tokens, std::int64_t dim,
                        std::int64_t heads, std::uint64_t seed, double scale = 2.0);
};

/// Host arrays of type T for a Problem, plus outputs poisoned with NaN.
template <class T>
struct Buffers {
  std::vector<T> cloud, relevance, content, bias, shift;
  std::vector<T> update, lse, entropy, weights;
  std::vector<std::int64_t> key_lengths;  // a copy, so a Buffers outlives its Problem
  AttentionInput<T> input;
  AttentionOutput<T> output;

  explicit Buffers(const Problem& p, bool with_weights = false, bool with_stats = true);
  void poison();
};

/// ||a - b|| / ||b|| in double (0 when both are zero). Entries where both are -inf count as
/// equal; any NaN in `a` makes the result NaN.
template <class A, class B>
double relative_error(const std::vector<A>& a, const std::vector<B>& b);

/// Largest |a_i - b_i| treating equal infinities as equal; NaN if any NaN.
template <class A, class B>
double max_abs_difference(const std::vector<A>& a, const std::vector<B>& b);

/// Fails the current test (returns false) if any entry is NaN; names the first index.
template <class T>
::testing::AssertionResult all_finite_or_neg_inf(const std::vector<T>& values);

/// True when a CUDA device is usable; otherwise records a clear skip reason.
bool cuda_available(std::string* reason);

}  // namespace emflow::testing

/// Use at the top of a GPU test: skips with the reason when no device is present.
#define EMFLOW_REQUIRE_CUDA()                                    \
  do {                                                           \
    std::string emflow_skip_reason;                              \
    if (!::emflow::testing::cuda_available(&emflow_skip_reason)) \
      GTEST_SKIP() << "no CUDA device: " << emflow_skip_reason;  \
  } while (0)
