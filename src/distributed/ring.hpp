// What the rings of sequence_parallel.hpp share: their clock, and the visibility tests of a
// block of queries against a block of keys.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <vector>

#include "emflow/attention.hpp"
#include "emflow/sequence_parallel.hpp"

namespace emflow::distributed::detail {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

/// May any query of [q.position, q.position + q.count) see any key of `keys` under the mask and
/// the key lengths? (A conservative test: false only when no pair is visible.)
inline bool any_visible(const Mask& mask, const Segment& q, const Segment& keys,
                        const std::vector<std::int64_t>* lengths) {
  if (lengths) {
    bool any = false;
    for (const std::int64_t length : *lengths) any |= length > keys.position && length > q.position;
    if (!any) return false;
  }
  const KeyRange first = mask.visible_keys_at(q.position, keys.position, keys.count);
  const KeyRange last = mask.visible_keys_at(q.position + q.count - 1, keys.position, keys.count);
  return first.first < last.last;
}

/// Per-cloud lengths of the run `s` when the whole cloud's first lengths[b] tokens are real.
inline std::vector<std::int64_t> local_lengths(const std::vector<std::int64_t>& lengths,
                                               const Segment& s) {
  std::vector<std::int64_t> out(lengths.size());
  for (std::size_t b = 0; b < lengths.size(); ++b) {
    out[b] = std::clamp<std::int64_t>(lengths[b] - s.position, 0, s.count);
  }
  return out;
}

}  // namespace emflow::distributed::detail
