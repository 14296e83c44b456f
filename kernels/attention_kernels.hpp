// Launchers of the attention kernels (fused_attention.cu, key_splits.cu, unfused_attention.cu).
// Each enqueues on `stream`, checks the launch, and never synchronises. Pointers are device
// pointers; shapes have been validated and fit in int (route() refuses larger ones; the plan,
// src/cuda/plan.cpp, asks it).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "emflow/attention.hpp"
#include "emflow/types.hpp"

namespace emflow::detail {

/// The mask as the kernels see it (mask.cuh): the caller's Mask (its visible_keys_at is the rule
/// the kernels apply), the per-cloud lengths (device arrays of `batch` entries, or null for all
/// keys / all queries) and the sequence positions of key 0 and query 0 (AttentionInput; the
/// per-cloud query_positions a device array too).
struct KernelMask {
  Mask rule;
  const std::int64_t* key_lengths = nullptr;
  const std::int64_t* query_lengths = nullptr;
  std::int64_t key_position = 0;
  std::int64_t query_position = kAlignToEnd;
  const std::int64_t* query_positions = nullptr;
};

/// Where a kernel writes per-head rows of (queries, dim) and per-head statistics: the row of
/// query i of cloud b and head h starts at rows + (b * batch_stride + h * head_stride) + i * dim,
/// its statistic is at (b * heads + h) * queries + i. `split_*` step to the next key split.
struct HeadRows {
  float* rows = nullptr;
  float* lse = nullptr;      ///< or null
  float* entropy = nullptr;  ///< or null
  std::size_t batch_stride = 0, head_stride = 0;
  std::size_t split_rows = 0, split_stats = 0;
};

/// Flash-style fused attention in float for one layer (all clouds, all heads): per head, the
/// normalised update o_h (the partial state of partial.hpp, base e), lse and entropy.
struct FusedAttentionArgs {
  const float* query = nullptr;    ///< (heads, batch, queries, dim): beta log2(e) (Q M_h + u_h)
  const float* cloud = nullptr;    ///< (batch, tokens, dim): the keys
  const float* content = nullptr;  ///< (heads, batch, tokens, dim): C_h = X F_h^T
  const float* offset = nullptr;   ///< (dim) added to queries that see a key; only with heads == 1
  HeadRows out;
  int batch = 1, heads = 1, tokens = 1, queries = 1, dim = 1;
  /// Keys per split (a multiple of 64) when the keys are split over `splits` blocks per query
  /// block; tokens and 1 otherwise.
  int split_keys = 1, splits = 1;
  /// Write partial states (partial.hpp): a query whose visible scores are all -inf gets
  /// lse = -inf, H = NaN and its contents times 0, rather than attend's NaN.
  bool partial_state = false;
  KernelMask mask;
};

/// Largest dim the fused kernel handles.
constexpr int kFusedMaxDim = 256;
/// Keys of one tile of the fused kernel: key splits are multiples of it.
constexpr int kFusedBlockKeys = 64;
/// Queries of one block of the fused kernel.
constexpr int kFusedBlockQueries = 64;

/// Dynamic shared memory the fused kernel needs for `dim` (bytes).
std::size_t fused_shared_bytes(int dim);

/// Allows the fused kernel for `dim` its fused_shared_bytes on the current device
/// (cudaFuncSetAttribute). The setting belongs to that device and lasts until cudaDeviceReset:
/// a plan calls this once, when it is made, on its device.
void prepare_fused_attention(int dim, const char* operation);

void launch_fused_attention(const FusedAttentionArgs& args, cudaStream_t stream,
                            const char* operation);

/// update[b, i, :] = sum_h partial[h, b, i, :] in head order, plus offset for queries that see a
/// key.
void launch_sum_heads(const float* partial, const float* offset, float* update, int batch,
                      int heads, int tokens, int queries, int dim, const KernelMask& mask,
                      cudaStream_t stream, const char* operation);

/// Merges `splits` partial states (written by the fused kernel with HeadRows over
/// (split, batch, heads, queries, dim) and (split, batch, heads, queries), or by the tensor-core
/// kernel over (split, heads, batch, ...)) in split order. With `update`: update = sum_h o_h +
/// offset (offset where the query sees a key), lse and entropy (either may be null) as attend
/// writes them; the rows are then (batch, heads) ordered. Otherwise each state row is merged on
/// its own into heads_out, lse_out and entropy_out (same layout as a split's slice, whichever
/// order of batch and heads that is): as a partial state, or with `attend_states` as attend's
/// per-head result (every visible score -inf makes lse, entropy and the row NaN, as
/// finish_partial does).
struct SplitMerge {
  const float* rows = nullptr;
  const float* lse = nullptr;
  const float* entropy = nullptr;
  int splits = 1, batch = 1, heads = 1, queries = 1, dim = 1;
  const float* offset = nullptr;
  float* update = nullptr;  ///< (batch, queries, dim), or null
  float *heads_out = nullptr, *lse_out = nullptr, *entropy_out = nullptr;  ///< as a split's slice
  bool attend_states = false;
};
void launch_merge_splits(const SplitMerge& merge, cudaStream_t stream, const char* operation);

/// into = merge(into, part) over a partial state of `rows` = batch * heads * queries rows.
template <class T>
void launch_merge_partial(const T* part_heads, const T* part_lse, const T* part_entropy, T* heads,
                          T* lse, T* entropy, std::int64_t rows, int dim, cudaStream_t stream,
                          const char* operation);

/// update = sum_h heads + offset (where lse of some head is not -inf); lse and entropy copied
/// when not null.
template <class T>
void launch_finish_partial(const T* heads, const T* lse, const T* entropy, const T* offset,
                           T* update, T* lse_out, T* entropy_out, int batch, int head_count,
                           int queries, int dim, cudaStream_t stream, const char* operation);

/// rows[h, r, :] = scale * bias[h, :] for r < rows_per_head (the key-bias term before the GEMM).
template <class T>
void launch_broadcast_bias(T* rows, const T* bias, T scale, int heads, std::int64_t rows_per_head,
                           int dim, cudaStream_t stream, const char* operation);

/// In place on scores (batch, heads, queries, tokens): masked row softmax, lse and entropy;
/// `partial`: as a partial state (partial.hpp) where every visible score is -inf.
template <class T>
void launch_row_softmax(T* scores, T* lse, T* entropy, int batch, int heads, int tokens,
                        int queries, const KernelMask& mask, bool partial, cudaStream_t stream,
                        const char* operation);

/// rows[h, b, j, :] = 0 for padding tokens j >= L_b (nothing without key lengths).
template <class T>
void launch_zero_padding(T* rows, int heads, int batch, int tokens, int dim, const KernelMask& mask,
                         cudaStream_t stream, const char* operation);

/// update[b, i, :] += offset for visible queries (i < L_b, the key length).
template <class T>
void launch_add_offset(T* update, const T* offset, int batch, int tokens, int dim,
                       const KernelMask& mask, cudaStream_t stream, const char* operation);

/// Rows of (batch, heads, queries, dim) (row of b, h, i at (b * heads + h) * queries + i): zero
/// where query i of cloud b sees no key, else plus offset when offset is not null.
template <class T>
void launch_finish_rows(T* rows, const T* offset, int batch, int heads, int tokens, int queries,
                        int dim, const KernelMask& mask, cudaStream_t stream,
                        const char* operation);

}  // namespace emflow::detail
