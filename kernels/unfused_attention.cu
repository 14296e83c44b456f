// The small kernels of the unfused path (the products themselves are cuBLAS calls made in
// src/cuda/products_enqueue.cpp), in float and double:
//
//   broadcast_bias_kernel  writes beta u_h into every row of a head's relevance buffer, so that one
//       GEMM with a nonzero C coefficient forms beta (X M_h + 1 u_h^T).
//   row_softmax_kernel     one block per score row (cloud, head, query): max, then
//       Z = sum exp(s - m) and a = sum exp(s - m)(s - m) over the visible keys, then the row is
//       overwritten in place by p = exp(s - lse) (0 where masked); lse = m + log Z and
//       H = log Z - a / Z. A row with no visible key becomes zeros, lse = -inf, H = 0.
//       Reductions use a fixed tree, so the result is deterministic. The max drops NaN scores
//       but nothing else does: exp(NaN - m) makes Z, lse, H and the row's weights NaN, and a
//       row whose visible scores are all -inf gets m = -inf and -inf - -inf = NaN, as
//       docs/MATH.md §6.6 defines; no score is tested for NaN.
//   add_offset_kernel      adds c to the update of every visible query (self-attention, the flow).
//   finish_rows_kernel     per-head or summed update rows: zero for a query that sees no key
//       (padding, or a query before every key: P is 0 there but C may hold NaN), else plus c.
//   zero_padding_kernel    zeroes the content rows of padding tokens (j >= L_b), which may hold
//       anything, even NaN: P C multiplies them by weight 0, and 0 * NaN would spread NaN.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "attention_kernels.hpp"
#include "cuda/cuda_support.hpp"
#include "launch.cuh"
#include "mask.cuh"

namespace emflow::detail {

namespace {

constexpr int kSoftmaxThreads = 256;
constexpr int kWarps = kSoftmaxThreads / 32;

__device__ __forceinline__ float exp_of(float x) { return expf(x); }
__device__ __forceinline__ double exp_of(double x) { return exp(x); }
__device__ __forceinline__ float log_of(float x) { return logf(x); }
__device__ __forceinline__ double log_of(double x) { return log(x); }

template <class T>
__global__ void broadcast_bias_kernel(T* __restrict__ rows, const T* __restrict__ bias, T scale,
                                      int heads, std::int64_t rows_per_head, int dim) {
  const std::size_t per_head = static_cast<std::size_t>(rows_per_head) * dim;
  const std::size_t total = per_head * heads;
  for (std::size_t index = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
       index < total; index += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const std::size_t h = index / per_head;
    const std::size_t a = index % dim;
    rows[index] = scale * bias[h * dim + a];
  }
}

// Reduces `value` over the block (max when `is_max`, else sum) in a fixed order; every thread
// gets the result. `scratch` holds kWarps values; the call begins and ends with a barrier so
// the scratch can be reused at once.
template <class T>
__device__ T block_reduce(T value, bool is_max, T* scratch) {
#pragma unroll
  for (int lane_mask = 16; lane_mask > 0; lane_mask >>= 1) {
    const T other = __shfl_xor_sync(0xffffffffu, value, lane_mask);
    value = is_max ? (other > value ? other : value) : value + other;
  }
  const int warp = static_cast<int>(threadIdx.x) / 32;
  __syncthreads();
  if ((threadIdx.x & 31) == 0) scratch[warp] = value;
  __syncthreads();
  T result = scratch[0];
  for (int w = 1; w < kWarps; ++w) {
    result = is_max ? (scratch[w] > result ? scratch[w] : result) : result + scratch[w];
  }
  __syncthreads();
  return result;
}

template <class T>
__global__ void __launch_bounds__(kSoftmaxThreads)
    row_softmax_kernel(T* __restrict__ scores, T* __restrict__ lse, T* __restrict__ entropy,
                       int heads, int tokens, int queries, KernelMask mask, bool partial) {
  EMFLOW_SHARED(T, scratch, [kWarps]);
  const std::size_t row = blockIdx.x;  // (b * heads + h) * queries + i
  const int i = static_cast<int>(row % static_cast<std::size_t>(queries));
  const int b = static_cast<int>(row / (static_cast<std::size_t>(queries) * heads));
  T* const s = scores + row * static_cast<std::size_t>(tokens);
  int first = 0, last = 0;
  visible_keys(mask, cloud_view(mask, b, tokens, queries), i, &first, &last);

  if (first >= last) {  // no visible key
    for (int j = static_cast<int>(threadIdx.x); j < tokens; j += kSoftmaxThreads) s[j] = T(0);
    if (threadIdx.x == 0) {
      if (lse != nullptr) lse[row] = -INFINITY;
      if (entropy != nullptr) entropy[row] = T(0);
    }
    return;
  }

  T local_max = -INFINITY;
  for (int j = first + static_cast<int>(threadIdx.x); j < last; j += kSoftmaxThreads) {
    local_max = s[j] > local_max ? s[j] : local_max;
  }
  const T row_max = block_reduce(local_max, true, scratch);

  // A partial state (partial.hpp) tells every visible score -inf (weights 0, lse = -inf,
  // H = NaN) from a NaN among them: measured from 0 rather than from the max of -inf, the first
  // sums to 0 and the second to NaN.
  const T reference = partial && row_max == -INFINITY ? T(0) : row_max;
  T local_sum = 0, local_moment = 0;
  for (int j = first + static_cast<int>(threadIdx.x); j < last; j += kSoftmaxThreads) {
    const T centred = s[j] - reference;
    const T weight = exp_of(centred);
    local_sum += weight;
    // A visible score of -inf has weight 0 and adds nothing to the entropy (0 * -inf would).
    if (weight > T(0)) local_moment += weight * centred;
  }
  const T sum = block_reduce(local_sum, false, scratch);
  const T moment = block_reduce(local_moment, false, scratch);
  if (partial && row_max == -INFINITY && sum == T(0)) {
    for (int j = static_cast<int>(threadIdx.x); j < tokens; j += kSoftmaxThreads) s[j] = T(0);
    if (threadIdx.x == 0) {
      if (lse != nullptr) lse[row] = -INFINITY;
      if (entropy != nullptr) entropy[row] = T(NAN);
    }
    return;
  }
  const T log_sum = log_of(sum);
  const T row_lse = row_max + log_sum;

  for (int j = static_cast<int>(threadIdx.x); j < tokens; j += kSoftmaxThreads) {
    s[j] = (j >= first && j < last) ? exp_of(s[j] - row_lse) : T(0);
  }
  if (threadIdx.x == 0) {
    if (lse != nullptr) lse[row] = row_lse;
    if (entropy != nullptr) entropy[row] = log_sum - moment / sum;
  }
}

template <class T>
__global__ void add_offset_kernel(T* __restrict__ update, const T* __restrict__ offset, int batch,
                                  int tokens, int dim, KernelMask mask) {
  for_each_token_element(batch, tokens, dim, [&](std::size_t index, int b, int i, int a) {
    if (i < visible_length(mask, b, tokens)) update[index] += offset[a];
  });
}

template <class T>
__global__ void finish_rows_kernel(T* __restrict__ rows, const T* __restrict__ offset, int batch,
                                   int heads, int tokens, int queries, int dim, KernelMask mask) {
  // (batch * heads) clouds of `queries` rows; the cloud of row group g is g / heads.
  for_each_token_element(batch * heads, queries, dim, [&](std::size_t index, int g, int i, int a) {
    if (!sees_a_key(mask, g / heads, tokens, queries, i)) {
      rows[index] = T(0);
    } else if (offset != nullptr) {
      rows[index] += offset[a];
    }
  });
}

template <class T>
__global__ void zero_padding_kernel(T* __restrict__ rows, int heads, int batch, int tokens, int dim,
                                    KernelMask mask) {
  const std::size_t per_cloud = static_cast<std::size_t>(tokens) * dim;
  const std::size_t total = per_cloud * batch * heads;
  for (std::size_t index = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
       index < total; index += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const int b = static_cast<int>((index / per_cloud) % static_cast<std::size_t>(batch));
    const int j = static_cast<int>((index % per_cloud) / dim);
    if (j >= visible_length(mask, b, tokens)) rows[index] = T(0);
  }
}

}  // namespace

template <class T>
void launch_zero_padding(T* rows, int heads, int batch, int tokens, int dim, const KernelMask& mask,
                         cudaStream_t stream, const char* operation) {
  if (mask.key_lengths == nullptr) return;
  const std::size_t total = static_cast<std::size_t>(heads) * batch * tokens * dim;
  launch(operation, "zero_padding_kernel", zero_padding_kernel<T>, grid_for(total), 256, 0, stream,
         rows, heads, batch, tokens, dim, mask);
}

template <class T>
void launch_broadcast_bias(T* rows, const T* bias, T scale, int heads, std::int64_t rows_per_head,
                           int dim, cudaStream_t stream, const char* operation) {
  const std::size_t total = static_cast<std::size_t>(rows_per_head) * dim * heads;
  launch(operation, "broadcast_bias_kernel", broadcast_bias_kernel<T>, grid_for(total), 256, 0,
         stream, rows, bias, scale, heads, rows_per_head, dim);
}

template <class T>
void launch_row_softmax(T* scores, T* lse, T* entropy, int batch, int heads, int tokens,
                        int queries, const KernelMask& mask, bool partial, cudaStream_t stream,
                        const char* operation) {
  const std::size_t rows = static_cast<std::size_t>(batch) * heads * queries;
  launch(operation, "row_softmax_kernel", row_softmax_kernel<T>, static_cast<unsigned>(rows),
         kSoftmaxThreads, 0, stream, scores, lse, entropy, heads, tokens, queries, mask, partial);
}

template <class T>
void launch_finish_rows(T* rows, const T* offset, int batch, int heads, int tokens, int queries,
                        int dim, const KernelMask& mask, cudaStream_t stream,
                        const char* operation) {
  const std::size_t total = static_cast<std::size_t>(batch) * heads * queries * dim;
  launch(operation, "finish_rows_kernel", finish_rows_kernel<T>, grid_for(total), 256, 0, stream,
         rows, offset, batch, heads, tokens, queries, dim, mask);
}

template <class T>
void launch_add_offset(T* update, const T* offset, int batch, int tokens, int dim,
                       const KernelMask& mask, cudaStream_t stream, const char* operation) {
  const std::size_t total = static_cast<std::size_t>(batch) * tokens * dim;
  launch(operation, "add_offset_kernel", add_offset_kernel<T>, grid_for(total), 256, 0, stream,
         update, offset, batch, tokens, dim, mask);
}

#define EMFLOW_INSTANTIATE_UNFUSED(T)                                                              \
  template void launch_broadcast_bias<T>(T*, const T*, T, int, std::int64_t, int, cudaStream_t,    \
                                         const char*);                                             \
  template void launch_row_softmax<T>(T*, T*, T*, int, int, int, int, const KernelMask&, bool,     \
                                      cudaStream_t, const char*);                                  \
  template void launch_finish_rows<T>(T*, const T*, int, int, int, int, int, const KernelMask&,    \
                                      cudaStream_t, const char*);                                  \
  template void launch_add_offset<T>(T*, const T*, int, int, int, const KernelMask&, cudaStream_t, \
                                     const char*);                                                 \
  template void launch_zero_padding<T>(T*, int, int, int, int, const KernelMask&, cudaStream_t,    \
                                       const char*);
EMFLOW_INSTANTIATE_UNFUSED(float)
EMFLOW_INSTANTIATE_UNFUSED(double)
#undef EMFLOW_INSTANTIATE_UNFUSED

}  // namespace emflow::detail
