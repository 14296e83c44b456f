// Partial states on the device (emflow/partial.hpp): the merge of the key splits of the fused
// kernel (flash-decoding), and the element-wise merge and finish of the public partial API.
//
//   merge_splits_kernel   one thread per (cloud, query, column): for each head, the max m of the
//       splits' lse, then with w_s = exp(lse_s - m) over the splits that saw a key, in split
//       order: lse = m + log sum w_s, o = sum w_s o_s / sum w_s, H = lse - sum w_s (lse_s - H_s)
//       / sum w_s. Writes the heads' sum plus the offset (an update, as attend does) or the
//       merged per-head state. A fixed order and no atomics: deterministic.
//   merge_partial_kernel  one thread per state row (cloud, head, query), into = merge(into, part)
//       in place; a row reads and writes only its own elements, so in place is safe.
//   finish_partial_kernel one thread per (cloud, query, column): the sum over heads in head
//       order, plus the offset where some head saw a key; lse and entropy copied.
//
// A part whose lse is -inf saw no key: it has weight 0 and is skipped (its o is 0 and changes
// nothing). A NaN lse makes the weights' sum NaN, so lse, o and H come out NaN (docs/MATH.md
// §6.6); a finite lse whose weight underflows to 0 still multiplies its o, so a NaN there (a
// non-finite content the part saw) reaches the result.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "attention_kernels.hpp"
#include "cuda_support.hpp"
#include "launch.cuh"

namespace emflow::detail {

namespace {

__device__ __forceinline__ float exp_of(float x) { return expf(x); }
__device__ __forceinline__ double exp_of(double x) { return exp(x); }
__device__ __forceinline__ float log_of(float x) { return logf(x); }
__device__ __forceinline__ double log_of(double x) { return log(x); }

__global__ void merge_splits_kernel(const SplitMerge m) {
  const std::size_t stats = static_cast<std::size_t>(m.batch) * m.heads * m.queries;
  const std::size_t rows = stats * m.dim;
  for_each_token_element(m.batch, m.queries, m.dim, [&](std::size_t index, int b, int i, int a) {
    float total = 0.f;
    bool sees_key = false;
    for (int h = 0; h < m.heads; ++h) {
      const std::size_t stat = (static_cast<std::size_t>(b) * m.heads + h) * m.queries + i;
      float top = -INFINITY;
      for (int s = 0; s < m.splits; ++s) top = fmaxf(top, m.lse[s * stats + stat]);
      const float reference = top == -INFINITY ? 0.f : top;
      float sum = 0.f, moment = 0.f, value = 0.f;
      for (int s = 0; s < m.splits; ++s) {
        const float part = m.lse[s * stats + stat];
        if (part == -INFINITY) continue;
        const float weight = expf(part - reference);
        sum += weight;
        moment = fmaf(weight, part - m.entropy[s * stats + stat], moment);
        value = fmaf(weight, m.rows[s * rows + stat * m.dim + a], value);
      }
      // sum is 0 only when no split saw a key; NaN when one holds NaN.
      const bool any = !(sum == 0.f);
      const float lse = any ? reference + logf(sum) : -INFINITY;
      const float o = any ? value / sum : 0.f;
      const float entropy = any ? lse - moment / sum : 0.f;
      sees_key = sees_key || any;
      if (m.update != nullptr) {
        total += o;
      } else {
        m.heads_out[stat * m.dim + a] = o;
      }
      if (a == 0) {
        float* const lse_out = m.lse_out;
        float* const entropy_out = m.entropy_out;
        if (lse_out != nullptr) lse_out[stat] = lse;
        if (entropy_out != nullptr) entropy_out[stat] = entropy;
      }
    }
    if (m.update != nullptr) {
      if (m.offset != nullptr && sees_key) total += m.offset[a];
      m.update[index] = total;
    }
  });
}

template <class T>
__global__ void merge_partial_kernel(const T* __restrict__ part_heads,
                                     const T* __restrict__ part_lse,
                                     const T* __restrict__ part_entropy, T* __restrict__ heads,
                                     T* __restrict__ lse, T* __restrict__ entropy,
                                     std::int64_t rows, int dim) {
  for (std::size_t r = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
       r < static_cast<std::size_t>(rows); r += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const T la = part_lse[r], lb = lse[r];
    if (la == -INFINITY) continue;  // the part saw no key
    T* const o = heads + r * dim;
    const T* const oa = part_heads + r * dim;
    if (lb == -INFINITY) {  // only the part saw a key
      for (int a = 0; a < dim; ++a) o[a] = oa[a];
      lse[r] = la;
      entropy[r] = part_entropy[r];
      continue;
    }
    // A NaN on either side makes top or a weight NaN, and so every result.
    const T top = la > lb ? la : lb;
    const T ea = exp_of(la - top), eb = exp_of(lb - top);
    const T merged = top + log_of(ea + eb);
    const T wa = exp_of(la - merged), wb = exp_of(lb - merged);
    for (int a = 0; a < dim; ++a) o[a] = wa * oa[a] + wb * o[a];
    entropy[r] = merged - wa * (la - part_entropy[r]) - wb * (lb - entropy[r]);
    lse[r] = merged;
  }
}

template <class T>
__global__ void finish_partial_kernel(const T* __restrict__ heads, const T* __restrict__ lse,
                                      const T* __restrict__ entropy, const T* __restrict__ offset,
                                      T* __restrict__ update, T* __restrict__ lse_out,
                                      T* __restrict__ entropy_out, int batch, int head_count,
                                      int queries, int dim) {
  for_each_token_element(batch, queries, dim, [&](std::size_t index, int b, int i, int a) {
    T value = 0;
    bool sees_key = false;
    for (int h = 0; h < head_count; ++h) {
      const std::size_t stat = (static_cast<std::size_t>(b) * head_count + h) * queries + i;
      value += heads[stat * dim + a];
      sees_key = sees_key || !(lse[stat] == -INFINITY);
      if (a == 0) {
        if (lse_out != nullptr) lse_out[stat] = lse[stat];
        if (entropy_out != nullptr) entropy_out[stat] = entropy[stat];
      }
    }
    if (offset != nullptr && sees_key) value += offset[a];
    update[index] = value;
  });
}

}  // namespace

void launch_merge_splits(const SplitMerge& merge, cudaStream_t stream, const char* operation) {
  const std::int64_t total = static_cast<std::int64_t>(merge.batch) * merge.queries * merge.dim;
  launch(operation, "merge_splits_kernel", merge_splits_kernel, grid_for(total),
         kElementwiseThreads, 0, stream, merge);
}

template <class T>
void launch_merge_partial(const T* part_heads, const T* part_lse, const T* part_entropy, T* heads,
                          T* lse, T* entropy, std::int64_t rows, int dim, cudaStream_t stream,
                          const char* operation) {
  launch(operation, "merge_partial_kernel", merge_partial_kernel<T>, grid_for(rows),
         kElementwiseThreads, 0, stream, part_heads, part_lse, part_entropy, heads, lse, entropy,
         rows, dim);
}

template <class T>
void launch_finish_partial(const T* heads, const T* lse, const T* entropy, const T* offset,
                           T* update, T* lse_out, T* entropy_out, int batch, int head_count,
                           int queries, int dim, cudaStream_t stream, const char* operation) {
  const std::int64_t total = static_cast<std::int64_t>(batch) * queries * dim;
  launch(operation, "finish_partial_kernel", finish_partial_kernel<T>, grid_for(total),
         kElementwiseThreads, 0, stream, heads, lse, entropy, offset, update, lse_out, entropy_out,
         batch, head_count, queries, dim);
}

#define EMFLOW_INSTANTIATE_PARTIAL(T)                                                             \
  template void launch_merge_partial<T>(const T*, const T*, const T*, T*, T*, T*, std::int64_t,   \
                                        int, cudaStream_t, const char*);                          \
  template void launch_finish_partial<T>(const T*, const T*, const T*, const T*, T*, T*, T*, int, \
                                         int, int, int, cudaStream_t, const char*);
EMFLOW_INSTANTIATE_PARTIAL(float)
EMFLOW_INSTANTIATE_PARTIAL(double)
#undef EMFLOW_INSTANTIATE_PARTIAL

}  // namespace emflow::detail
