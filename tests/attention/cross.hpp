// Cross-attention problems for the tests over every backend: queries Q (B, Nq, d) against keys
// X (B, N, d) with key and query lengths and sequence positions, an oracle written from the
// definition (docs/MATH.md §1.6: each pair of positions put to Mask::allows, independently of
// Mask::visible_keys_at and of every backend), and a runner that puts a problem to a target.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "attention/backends.hpp"
#include "emflow/attention.hpp"
#include "emflow/partial.hpp"

namespace emflow::testing {

/// A cross-attention problem in double (values rounded to float, so both precisions agree).
struct CrossProblem {
  std::int64_t batch = 1, heads = 1, tokens = 1, query_tokens = 1, dim = 1;
  Mask mask;
  double beta = 1.0;
  bool self = false;  ///< queries null: self-attention through the cross-attention fields
  bool bias = false, offset = false;
  std::vector<std::int64_t> key_lengths, query_lengths;  ///< empty: none
  std::int64_t key_position = 0;
  std::int64_t query_position = kAlignToEnd;
  std::vector<std::int64_t> query_positions;  ///< empty: none
  std::vector<double> cloud, queries, relevance, content, key_bias, shift;

  /// Random arrays for the shape (operators scaled by 2 / sqrt(d), so the softmax is not flat).
  void fill(std::uint64_t seed);
  std::int64_t rows() const { return self ? tokens : query_tokens; }
  /// The key length and query length of cloud b, and the position of its query 0.
  std::int64_t key_length(std::int64_t b) const;
  std::int64_t query_length(std::int64_t b) const;
  std::int64_t query_origin(std::int64_t b) const;
};

/// What a problem gives: update (B, Nq, d), lse and entropy (B, H, Nq), weights (B, H, Nq, N).
struct CrossResult {
  std::vector<double> update, lse, entropy, weights;
};

/// The oracle: every output from the definition, in double.
CrossResult cross_oracle(const CrossProblem& problem);

/// A problem's arrays in T with NaN-poisoned outputs, and the AttentionInput/Output over them.
template <class T>
struct CrossBuffers {
  std::vector<T> cloud, queries, relevance, content, key_bias, shift;
  std::vector<T> update, lse, entropy, weights;
  std::vector<std::int64_t> key_lengths, query_lengths, query_positions;
  AttentionInput<T> input;
  AttentionOutput<T> output;

  CrossBuffers(const CrossProblem& problem, bool with_weights);
  void poison();
};

/// Runs the buffers on the target. Every target computes cross-attention: an
/// ErrorCode::unsupported reaches the test and fails it (route() refuses none of these calls).
template <class T>
void run_cross(const Target& target, CrossBuffers<T>& buffers);

/// Every output of `got` agrees with the oracle to `tolerance` (none left poisoned; padding and
/// queries without keys exactly 0, -inf, 0). Fails (without aborting) naming `what`.
template <class T>
void expect_cross_matches(const CrossBuffers<T>& got, const CrossResult& want, double tolerance,
                          const std::string& what);

}  // namespace emflow::testing
