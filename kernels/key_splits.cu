// Partial states on the device (emflow/partial.hpp): the merge of the key splits of the fused
// kernel (flash-decoding), and the element-wise merge and finish of the public partial API. Each
// follows the host's merge_partial and finish_partial (src/core/partial.cpp) formula for formula:
//
//   lse = m + log1p(exp(min - m)), w = exp(l - lse), o = sum w o_part,
//   H = sum over parts with a finite lse of w (H_part + lse - l_part),
//
// with the states of partial.hpp: lse = -inf with H = 0 (no visible key: o = 0, changes nothing),
// lse = -inf with H = NaN (every visible score -inf: o is its contents times 0), and a NaN or
// +inf lse, which makes the merged state NaN. A part with lse = -inf still meets its weight 0,
// so a NaN among its contents reaches the result, as in one pass.
//
//   merge_splits_kernel   one thread per (cloud, query, column) of an update: for each head, the
//       splits folded in split order, then the head sum plus the offset, as attend writes it.
//   merge_split_rows_kernel  one thread per (state row, column): the splits folded in split
//       order into the per-head state (the fused kernel's partial state, the tensor-core
//       kernel's per-head result, which its combine then sums over heads).
//   merge_partial_kernel  one thread per state row (cloud, head, query), into = merge(into, part)
//       in place; a row reads and writes only its own elements, so in place is safe.
//   finish_partial_kernel one thread per (cloud, query, column): the sum over heads in head
//       order, plus the offset where some head saw a key; lse and entropy.
// Fixed orders and no atomics: deterministic.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "attention_kernels.hpp"
#include "cuda/cuda_support.hpp"
#include "launch.cuh"

namespace emflow::detail {

namespace {

__device__ __forceinline__ float exp_of(float x) { return expf(x); }
__device__ __forceinline__ double exp_of(double x) { return exp(x); }
__device__ __forceinline__ float log1p_of(float x) { return log1pf(x); }
__device__ __forceinline__ double log1p_of(double x) { return log1p(x); }

// One part's state, merged into another's (the host's merge_partial, element by element).
template <class T>
struct State {
  T lse, entropy;
};

// The merged lse and entropy of `into` and `part`, and their weights (wa for into, wb for part).
// `nan`: either part is NaN (or +inf); `minus_inf`: both have lse = -inf (the weights are then 1:
// the contents add).
template <class T>
__device__ __forceinline__ State<T> merge_state(State<T> a, State<T> b, T* wa, T* wb) {
  const T inf = INFINITY;
  if (a.lse != a.lse || b.lse != b.lse || a.lse == inf || b.lse == inf) {
    *wa = *wb = T(NAN);
    return {T(NAN), T(NAN)};
  }
  if (a.lse == -inf && b.lse == -inf) {
    *wa = *wb = T(1);
    return {-inf, a.entropy != a.entropy || b.entropy != b.entropy ? T(NAN) : T(0)};
  }
  const T m = a.lse > b.lse ? a.lse : b.lse;
  const T lse = m + log1p_of(exp_of((a.lse > b.lse ? b.lse : a.lse) - m));
  *wa = exp_of(a.lse - lse);
  *wb = exp_of(b.lse - lse);
  T entropy = 0;
  if (a.lse != -inf) entropy += *wa * (a.entropy + (lse - a.lse));
  if (b.lse != -inf) entropy += *wb * (b.entropy + (lse - b.lse));
  return {lse, entropy};
}

// The splits of state row `stat`, column a, folded in split order: the merged row element, and
// its state in *state. Both merge kernels fold with this, so they agree to the bit.
__device__ __forceinline__ float fold_splits(const SplitMerge& m, std::size_t stat, int a,
                                             State<float>* state) {
  const std::size_t stats = static_cast<std::size_t>(m.batch) * m.heads * m.queries;
  const std::size_t rows = stats * m.dim;
  State<float> merged{m.lse[stat], m.entropy[stat]};
  float o = m.rows[stat * m.dim + a];
  for (int s = 1; s < m.splits; ++s) {
    float wa = 0.f, wb = 0.f;
    merged = merge_state(merged, State<float>{m.lse[s * stats + stat], m.entropy[s * stats + stat]},
                         &wa, &wb);
    o = wa * o + wb * m.rows[s * rows + stat * m.dim + a];
  }
  *state = merged;
  return o;
}

// As finish_partial: lse = -inf with H = NaN (every visible score -inf) is NaN. Returns whether
// the row saw a key.
__device__ __forceinline__ bool finish_state(State<float>* state) {
  const bool none = state->lse == -INFINITY && state->entropy == 0.f;
  if (state->lse == -INFINITY && !none) state->lse = state->entropy = NAN;
  return !none;
}

__global__ void merge_splits_kernel(const SplitMerge m) {
  for_each_token_element(m.batch, m.queries, m.dim, [&](std::size_t index, int b, int i, int a) {
    float total = 0.f;
    bool sees_key = false;
    for (int h = 0; h < m.heads; ++h) {
      const std::size_t stat = (static_cast<std::size_t>(b) * m.heads + h) * m.queries + i;
      State<float> state{};
      const float o = fold_splits(m, stat, a, &state);
      sees_key = finish_state(&state) || sees_key;
      total += state.lse != state.lse ? NAN : o;
      if (a == 0) {
        if (m.lse_out != nullptr) m.lse_out[stat] = state.lse;
        if (m.entropy_out != nullptr) m.entropy_out[stat] = state.entropy;
      }
    }
    if (m.offset != nullptr && sees_key) total += m.offset[a];
    m.update[index] = total;
  });
}

__global__ void merge_split_rows_kernel(const SplitMerge m) {
  const int state_rows = m.batch * m.heads;
  for_each_token_element(state_rows, m.queries, m.dim, [&](std::size_t, int row, int i, int a) {
    const std::size_t stat = static_cast<std::size_t>(row) * m.queries + i;
    State<float> state{};
    float o = fold_splits(m, stat, a, &state);
    if (m.attend_states) {
      finish_state(&state);
      if (state.lse != state.lse) o = NAN;
    }
    m.heads_out[stat * m.dim + a] = o;
    if (a == 0) {
      if (m.lse_out != nullptr) m.lse_out[stat] = state.lse;
      if (m.entropy_out != nullptr) m.entropy_out[stat] = state.entropy;
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
    T wa = 0, wb = 0;
    const State<T> merged =
        merge_state(State<T>{lse[r], entropy[r]}, State<T>{part_lse[r], part_entropy[r]}, &wa, &wb);
    T* const o = heads + r * dim;
    const T* const ob = part_heads + r * dim;
    for (int a = 0; a < dim; ++a) o[a] = wa * o[a] + wb * ob[a];
    lse[r] = merged.lse;
    entropy[r] = merged.entropy;
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
      T row_lse = lse[stat], row_entropy = entropy[stat];
      // Every head sees the same keys: lse = -inf with H = 0 in each means no key at all.
      const bool none = row_lse == -INFINITY && row_entropy == T(0);
      sees_key = sees_key || !none;
      if (row_lse == -INFINITY && !none) row_lse = row_entropy = T(NAN);  // all -inf (§6.6)
      value += row_lse != row_lse ? T(NAN) : heads[stat * dim + a];
      if (a == 0) {
        if (lse_out != nullptr) lse_out[stat] = row_lse;
        if (entropy_out != nullptr) entropy_out[stat] = row_entropy;
      }
    }
    if (offset != nullptr && sees_key) value += offset[a];
    update[index] = value;
  });
}

}  // namespace

void launch_merge_splits(const SplitMerge& merge, cudaStream_t stream, const char* operation) {
  if (merge.update == nullptr) {
    const std::int64_t total =
        static_cast<std::int64_t>(merge.batch) * merge.heads * merge.queries * merge.dim;
    launch(operation, "merge_split_rows_kernel", merge_split_rows_kernel, grid_for(total),
           kElementwiseThreads, 0, stream, merge);
    return;
  }
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
