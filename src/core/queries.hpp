// Which keys each query of an attend call sees: the one place that resolves query_tokens,
// query_lengths, key_position and query_position (AttentionInput, attention.hpp) into a
// per-cloud rule that every host backend applies (docs/MATH.md §1.6).
#pragma once

#include <cstdint>

#include "emflow/attention.hpp"

namespace emflow::detail {

/// The visibility rule of one cloud: its key length, query length and sequence positions.
struct QueryRule {
  Mask mask;
  std::int64_t key_length = 0;    ///< Lk_b: keys j < Lk_b are real
  std::int64_t query_length = 0;  ///< Lq_b: queries i < Lq_b are real, the others padding
  std::int64_t key_position = 0;  ///< position of key 0
  std::int64_t query_origin = 0;  ///< position of query 0 (kAlignToEnd resolved)

  /// The keys query i sees (empty for a padding query). Both ends are non-decreasing in i over
  /// the real queries, as Mask::visible_keys promises for self-attention.
  constexpr KeyRange keys(std::int64_t i) const {
    if (i < 0 || i >= query_length) return {0, 0};
    return mask.visible_keys_at(query_origin + i, key_position, key_length);
  }
};

/// Nq: query rows per cloud (the key count N for self-attention).
template <class T>
constexpr std::int64_t query_count(const AttentionInput<T>& in) {
  return in.queries != nullptr ? in.query_tokens : in.tokens;
}

/// The query rows: Q, or the cloud itself for self-attention.
template <class T>
constexpr const T* query_rows(const AttentionInput<T>& in) {
  return in.queries != nullptr ? in.queries : in.cloud;
}

/// The rule of cloud b of validated input.
template <class T>
constexpr QueryRule query_rule(const AttentionInput<T>& in, std::int64_t b) {
  QueryRule rule;
  rule.mask = in.mask;
  rule.key_length = in.key_lengths != nullptr ? in.key_lengths[b] : in.tokens;
  rule.query_length = in.query_lengths != nullptr ? in.query_lengths[b]
                      : in.queries != nullptr     ? in.query_tokens
                                                  : rule.key_length;
  rule.key_position = in.key_position;
  // The last real query beside the last real key: key_position + Lk - 1 = origin + Lq - 1.
  rule.query_origin = in.query_positions != nullptr ? in.query_positions[b]
                      : in.query_position != kAlignToEnd
                          ? in.query_position
                          : in.key_position + rule.key_length - rule.query_length;
  return rule;
}

}  // namespace emflow::detail
