// Which keys a query sees, on the device: Mask::visible_keys (emflow/types.hpp, the rule every
// backend applies) with the key length of the query's cloud read from device memory.
#pragma once

#include "attention_kernels.hpp"

namespace emflow::detail {

/// L_b clamped to [0, tokens]: the async API trusts but does not check device key lengths.
__device__ __forceinline__ int visible_length(const KernelMask& mask, int b, int tokens) {
  if (mask.key_lengths == nullptr) return tokens;
  const long long length = mask.key_lengths[b];
  return length < 0 ? 0 : (length > tokens ? tokens : static_cast<int>(length));
}

/// The keys [*first, *last) that query i of a cloud whose first `length` tokens are real sees;
/// empty for a padding query. Both ends lie in [0, length], so they fit in int.
__device__ __forceinline__ void visible_keys(int i, int length, const KernelMask& mask, int* first,
                                             int* last) {
  const KeyRange keys = mask.rule.visible_keys(i, length);
  *first = static_cast<int>(keys.first);
  *last = static_cast<int>(keys.last);
}

}  // namespace emflow::detail
