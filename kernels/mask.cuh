// Which keys a query sees, on the device (the same rule as Mask::allows plus key lengths).
#pragma once

#include "attention_kernels.hpp"

namespace emflow::detail {

/// L_b clamped to [0, tokens]: the async API trusts but does not check device key lengths.
__device__ __forceinline__ int visible_length(const KernelMask& mask, int b, int tokens) {
  if (mask.key_lengths == nullptr) return tokens;
  const long long length = mask.key_lengths[b];
  return length < 0 ? 0 : (length > tokens ? tokens : static_cast<int>(length));
}

/// Key j is visible to query i of a cloud whose first `length` tokens are real.
__device__ __forceinline__ bool key_visible(int i, int j, int length, const KernelMask& mask) {
  if (i >= length || j >= length) return false;
  if (mask.kind == 0) return true;
  return j <= i && (mask.kind == 1 || j > i - mask.window);
}

/// The visible keys of query i form one interval [first, last) under every mask; empty for a
/// padding query.
__device__ __forceinline__ void visible_keys(int i, int length, const KernelMask& mask, int* first,
                                             int* last) {
  *first = 0;
  *last = 0;
  if (i >= length) return;
  *last = mask.kind == 0 ? length : i + 1;
  if (mask.kind == 2) *first = i - mask.window + 1 > 0 ? i - mask.window + 1 : 0;
}

}  // namespace emflow::detail
