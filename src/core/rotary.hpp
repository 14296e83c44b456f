// Rotary positions of a factored layer (Rotary, factored.hpp; docs/MATH.md §2.4) for the host
// kernels: the checks of its fields, the frequencies of one call, the position of each row, and
// the rotation of one projected row. The engine (src/cpu/factored.cpp, engine.cpp) and the
// double reference of the factored form (src/reference/attend.cpp) share them, so both rotate
// the same pairs by the same angles.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "emflow/factored.hpp"
#include "queries.hpp"
#include "validate.hpp"

namespace emflow::detail {

/// The checks of `layer.kv_heads` and `layer.rotary` for a call of `batch` clouds of `tokens`
/// keys and `query_tokens` queries (invalid_argument naming the field, the expectation and the
/// value). The values of the explicit frequencies and positions are read for Lengths::host only.
void check_grouping_and_rotary(std::int64_t heads, std::int64_t rank, std::int64_t kv_heads,
                               const Rotary& rotary, std::int64_t batch, std::int64_t tokens,
                               std::int64_t query_tokens, const char* operation, Lengths lengths);

/// Refuses (ErrorCode::unsupported, naming rotary.scaling and `why`) the dynamic scaling without
/// explicit inverse_frequencies, whose frequencies depend on the call's longest sequence: a
/// computation that sees the keys in parts (a partial state, a decode cache) would rotate the
/// parts by different frequencies. Every other rotary embedding passes.
void check_fixed_frequencies(const Rotary& rotary, const char* operation, const char* why);

/// A rotary embedding resolved for one validated call: its frequencies and where its rows sit.
struct RotaryCall {
  std::int64_t dim = 0;  ///< 0: no rotation
  bool interleaved = false;
  std::vector<double> inverse_frequencies;  ///< dim / 2
  const std::int64_t* key_positions = nullptr;
  const std::int64_t* query_positions = nullptr;
  std::int64_t tokens = 0, query_tokens = 0;

  /// The rotary position of key j and of query i of cloud b under the cloud's `rule`.
  std::int64_t key_position(std::int64_t b, const QueryRule& rule, std::int64_t j) const {
    return key_positions != nullptr ? key_positions[b * tokens + j] : rule.key_position + j;
  }
  std::int64_t query_position(std::int64_t b, const QueryRule& rule, std::int64_t i) const {
    return query_positions != nullptr ? query_positions[b * query_tokens + i]
                                      : rule.query_origin + i;
  }

  /// cos and sin of the dim / 2 angles position * inv_freq_t, in double, as F.
  template <class F>
  void angles(std::int64_t position, F* cos_out, F* sin_out) const {
    for (std::int64_t t = 0; t < dim / 2; ++t) {
      const double angle =
          static_cast<double>(position) * inverse_frequencies[static_cast<std::size_t>(t)];
      cos_out[t] = static_cast<F>(std::cos(angle));
      sin_out[t] = static_cast<F>(std::sin(angle));
    }
  }

  /// Rotates the first `dim` coordinates of `row` by the angles (cos, sin), pair t being
  /// (t, t + dim/2) or (2t, 2t + 1): (a, b) -> (a cos - b sin, b cos + a sin).
  template <class F>
  void rotate(F* row, const F* cos_in, const F* sin_in) const {
    const std::int64_t half = dim / 2;
    for (std::int64_t t = 0; t < half; ++t) {
      F& a = row[interleaved ? 2 * t : t];
      F& b = row[interleaved ? 2 * t + 1 : t + half];
      const F x = a, y = b;
      a = x * cos_in[t] - y * sin_in[t];
      b = y * cos_in[t] + x * sin_in[t];
    }
  }
};

/// The rotary embedding of a validated attend_factored call (`layer.rotary.dim` 0: none): for
/// dynamic_ntk the longest sequence is 1 + the largest position it rotates a key or a query by.
template <class T>
RotaryCall rotary_call(const AttentionInput<T>& input, const Rotary& rotary);

}  // namespace emflow::detail
