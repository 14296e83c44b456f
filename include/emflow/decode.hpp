// emflow: incremental decoding of a growing cloud (docs/MATH.md §1.6).
//
// A decoder adds one token (or a few) at a time and attends the new tokens to everything before:
// in EMF terms a growing cloud whose keys and contents are kept. A DecodeCache holds, for one
// dense layer (M_h, F_h, u_h, c) and one cloud, the keys x_j (shared by every head: the relevance
// and the key bias act through the queries, s_ij = <beta (M_h^T q_i + u_h), x_j>) laid out for
// the score tiles, and per head the contents C_h = X F_h^T. append() adds tokens at O(n H d^2)
// for n tokens without touching the old ones; attend() updates a block of queries against the
// whole cache at O(Nq H N d), the keys split across threads when the queries are few.
//
// Positions: key j of the cache sits at position j; the queries of attend() at
// [query_position, query_position + Nq), by default (kAlignToEnd) the last Nq positions
// (size() - Nq + i), as in a decoder whose new tokens were just appended. Masks then act as for
// emflow::attend (attention.hpp). Decoding a cloud token by token (append x_t, attend x_t under
// the causal mask) gives the rows of the causal one-pass update.
//
// Computed in float32 on the CPU (the fused engine of Device::cpu); non-finite tokens are not
// supported (append refuses them, naming the token).
#pragma once

#include <cstdint>
#include <memory>

#include "emflow/attention.hpp"

namespace emflow {

class DecodeCache {
 public:
  /// Copies the operators of `layer` (heads, dim); throws emflow::Error (invalid_argument) on a
  /// null relevance or content, dim or heads < 1, or a non-finite beta.
  DecodeCache(const LayerOperators<float>& layer, std::int64_t dim, double beta = 1.0);
  ~DecodeCache();
  DecodeCache(DecodeCache&&) noexcept;
  DecodeCache& operator=(DecodeCache&&) noexcept;
  DecodeCache(const DecodeCache&) = delete;
  DecodeCache& operator=(const DecodeCache&) = delete;

  std::int64_t size() const noexcept;  ///< tokens held, N
  std::int64_t dim() const noexcept;
  std::int64_t heads() const noexcept;

  /// Appends `count` tokens (count x dim, row-major): their keys and their contents F_h x_j.
  /// Storage grows geometrically; the old tokens are moved, never recomputed. Throws
  /// emflow::Error (invalid_argument) naming the first row that holds a non-finite value.
  void append(const float* tokens, std::int64_t count);

  /// Drops every token (the operators stay).
  void clear() noexcept;

  /// The update of `count` queries (count x dim) against every token of the cache under `mask`,
  /// written to output.update (count x dim) and, when not null, output.lse and output.entropy
  /// (heads x count); output.weights must be null. Same rules as emflow::attend (a query that
  /// sees no key gets 0, -inf, 0).
  void attend(const float* queries, std::int64_t count, const Mask& mask,
              const AttentionOutput<float>& output, std::int64_t query_position = kAlignToEnd,
              int threads = 0) const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace emflow
