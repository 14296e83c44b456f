// Which keys a query sees, on the device: Mask::visible_keys_at (emflow/types.hpp, the rule every
// backend applies) at the positions of AttentionInput, with the key and query lengths of the
// query's cloud read from device memory.
#pragma once

#include <cstdint>

#include "attention_kernels.hpp"

namespace emflow::detail {

/// lengths[b] clamped to [0, count], or count without lengths: the async API trusts but does not
/// check device lengths.
__device__ __forceinline__ int clamped_length(const std::int64_t* lengths, int b, int count) {
  if (lengths == nullptr) return count;
  const long long length = lengths[b];
  return length < 0 ? 0 : (length > count ? count : static_cast<int>(length));
}

/// The key length L_b of cloud b.
__device__ __forceinline__ int visible_length(const KernelMask& mask, int b, int tokens) {
  return clamped_length(mask.key_lengths, b, tokens);
}

/// One cloud as the mask sees it: its key length, its query length and the sequence position of
/// its query 0 (AttentionInput: query_positions[b], else query_position, else key_position +
/// Lk - Lq, aligned bottom-right).
struct CloudView {
  int key_length = 0;
  int query_length = 0;
  long long first_position = 0;
};

__device__ __forceinline__ CloudView cloud_view(const KernelMask& mask, int b, int tokens,
                                                int queries) {
  CloudView view;
  view.key_length = clamped_length(mask.key_lengths, b, tokens);
  view.query_length = clamped_length(mask.query_lengths, b, queries);
  if (mask.query_positions != nullptr) {
    view.first_position = mask.query_positions[b];
  } else if (mask.query_position != kAlignToEnd) {
    view.first_position = mask.query_position;
  } else {
    view.first_position =
        mask.key_position + static_cast<long long>(view.key_length) - view.query_length;
  }
  return view;
}

/// The keys [*first, *last) that query i of the cloud sees; empty for a padding query
/// (i >= query length). Both ends lie in [0, key length], so they fit in int.
__device__ __forceinline__ void visible_keys(const KernelMask& mask, const CloudView& view, int i,
                                             int* first, int* last) {
  if (i < 0 || i >= view.query_length) {
    *first = 0;
    *last = 0;
    return;
  }
  const KeyRange keys =
      mask.rule.visible_keys_at(view.first_position + i, mask.key_position, view.key_length);
  *first = static_cast<int>(keys.first);
  *last = static_cast<int>(keys.last);
}

/// Whether query i of cloud b sees at least one key.
__device__ __forceinline__ bool sees_a_key(const KernelMask& mask, int b, int tokens, int queries,
                                           int i) {
  int first = 0, last = 0;
  visible_keys(mask, cloud_view(mask, b, tokens, queries), i, &first, &last);
  return first < last;
}

}  // namespace emflow::detail
