// Launchers of the attention kernels (fused_attention.cu, unfused_attention.cu). Each enqueues
// on `stream`, checks the launch, and never synchronises. Pointers are device pointers; shapes
// have been validated and fit in int (checked by the plan, attend_plan.cpp).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "emflow/types.hpp"

namespace emflow::detail {

/// The mask as the kernels see it: the caller's Mask (its visible_keys is the rule the kernels
/// apply) and `key_lengths`, a device array of `batch` entries or null (mask.cuh).
struct KernelMask {
  Mask rule;
  const std::int64_t* key_lengths = nullptr;
};

/// Flash-style fused attention in float for one layer (all clouds, all heads).
struct FusedAttentionArgs {
  const float* query = nullptr;    ///< (heads, batch, tokens, dim): beta log2(e) (X M_h + u_h)
  const float* cloud = nullptr;    ///< (batch, tokens, dim): the keys are the tokens themselves
  const float* content = nullptr;  ///< (heads, batch, tokens, dim): C_h = X F_h^T
  const float* offset = nullptr;   ///< (dim) added to visible queries; only with heads == 1
  float* out = nullptr;            ///< heads == 1: the update (batch, tokens, dim);
                                   ///< else per-head partial updates (heads, batch, tokens, dim)
  float* lse = nullptr;            ///< (batch, heads, tokens) or null
  float* entropy = nullptr;        ///< (batch, heads, tokens) or null
  int batch = 1, heads = 1, tokens = 1, dim = 1;
  KernelMask mask;
};

/// Largest dim the fused kernel handles.
constexpr int kFusedMaxDim = 256;

/// Dynamic shared memory the fused kernel needs for `dim` (bytes).
std::size_t fused_shared_bytes(int dim);

/// Allows the fused kernel for `dim` its fused_shared_bytes on `device`, the current device
/// (cudaFuncSetAttribute; the setting lasts, so the call is made once per process, device and
/// tile width, however often this is called).
void prepare_fused_attention(int dim, int device, const char* operation);

void launch_fused_attention(const FusedAttentionArgs& args, cudaStream_t stream,
                            const char* operation);

/// update[b, i, :] = sum_h partial[h, b, i, :] in head order, plus offset for visible queries.
void launch_sum_heads(const float* partial, const float* offset, float* update, int batch,
                      int heads, int tokens, int dim, const KernelMask& mask, cudaStream_t stream,
                      const char* operation);

/// rows[h, r, :] = scale * bias[h, :] for r < rows_per_head (the key-bias term before the GEMM).
template <class T>
void launch_broadcast_bias(T* rows, const T* bias, T scale, int heads, std::int64_t rows_per_head,
                           int dim, cudaStream_t stream, const char* operation);

/// In place on scores (batch, heads, tokens, tokens): masked row softmax, lse and entropy.
template <class T>
void launch_row_softmax(T* scores, T* lse, T* entropy, int batch, int heads, int tokens,
                        const KernelMask& mask, cudaStream_t stream, const char* operation);

/// rows[h, b, j, :] = 0 for padding tokens j >= L_b (nothing without key lengths).
template <class T>
void launch_zero_padding(T* rows, int heads, int batch, int tokens, int dim, const KernelMask& mask,
                         cudaStream_t stream, const char* operation);

/// update[b, i, :] += offset for visible queries (i < L_b).
template <class T>
void launch_add_offset(T* update, const T* offset, int batch, int tokens, int dim,
                       const KernelMask& mask, cudaStream_t stream, const char* operation);

}  // namespace emflow::detail
