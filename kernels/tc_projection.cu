// The projections and the sum over heads of the 16-bit tensor-core paths (tc_projection.hpp).
// Plain element-wise products: d and the rank are small next to N, and the attention dominates
// from a few hundred tokens on.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "emflow/precision.hpp"
#include "launch.cuh"
#include "mask.cuh"
#include "storage.cuh"
#include "tc_projection.hpp"

namespace emflow::detail {

namespace {

// sum_k w(h, c, k) x_k in float32.
template <class T>
__device__ __forceinline__ float project_one(const T* weights, bool transposed, const T* xr, int h,
                                             int c, int dim, int rank) {
  float sum = 0.f;
  if (transposed) {
    const T* const w = weights + static_cast<std::size_t>(h) * dim * rank + c;
    for (int k = 0; k < dim; ++k)
      sum += widen(w[static_cast<std::size_t>(k) * rank]) * widen(xr[k]);
  } else {
    const T* const w = weights + (static_cast<std::size_t>(h) * rank + c) * dim;
    for (int k = 0; k < dim; ++k) sum += widen(w[k]) * widen(xr[k]);
  }
  return sum;
}

template <class T, class Out>
__global__ void project_kernel(const T* weights, bool transposed, const T* x, Out* out, int heads,
                               int rows, int dim, int rank, const TcRotary rotary) {
  const std::size_t total = static_cast<std::size_t>(heads) * rows * rank;
  for (std::size_t index = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
       index < total; index += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const int c = static_cast<int>(index % rank);
    const std::size_t head_row = index / rank;
    const int row = static_cast<int>(head_row % rows);
    const int h = static_cast<int>(head_row / rows);
    const T* const xr = x + static_cast<std::size_t>(row) * dim;
    float sum = project_one(weights, transposed, xr, h, c, dim, rank);
    if (c < rotary.dim) {
      // This coordinate and its partner of the pair, turned by the row's angle; the thread of
      // the partner computes the same two sums and writes the other half of the pair.
      const int half = rotary.dim / 2;
      const bool first = rotary.interleaved ? c % 2 == 0 : c < half;
      const int partner = rotary.interleaved ? c ^ 1 : first ? c + half : c - half;
      const int t = rotary.interleaved ? c / 2 : first ? c : c - half;
      const float other = project_one(weights, transposed, xr, h, partner, dim, rank);
      const int cloud = row / rotary.cloud_rows, n = row % rotary.cloud_rows;
      const long long origin =
          rotary.queries
              ? cloud_view(rotary.mask, cloud, rotary.tokens, rotary.query_tokens).first_position
              : rotary.mask.key_position;
      const double angle = static_cast<double>(origin + n) * rotary.inverse_frequencies[t];
      const double cosine = cos(angle), sine = sin(angle);
      sum = static_cast<float>(first ? sum * cosine - other * sine : sum * cosine + other * sine);
    }
    store(out + index, sum);
  }
}

template <class T>
__global__ void combine_kernel(const TcCombineArgs args, const T* up, const T* offset, T* update) {
  const int H = args.heads, B = args.batch, Nq = args.queries, d = args.dim, r = args.rank;
  for_each_token_element(B, Nq, d, [&](std::size_t index, int b, int i, int a) {
    // Every head sees the same keys: head 0's lse says whether the query sees any.
    const bool sees_key = !(args.lse[static_cast<std::size_t>(b) * Nq + i] == -INFINITY);
    float sum = 0.f;
    if (sees_key) {
      for (int h = 0; h < H; ++h) {
        const float* const o =
            args.heads_out + ((static_cast<std::size_t>(h) * B + b) * Nq + i) * r;
        if (up == nullptr) {
          sum += o[a];
        } else {
          const T* const u = up + (static_cast<std::size_t>(h) * d + a) * r;
          for (int c = 0; c < r; ++c) sum += widen(u[c]) * o[c];
        }
      }
      if (offset != nullptr) sum += widen(offset[a]);
    }
    store(update + index, sum);
    if (a == 0) {
      for (int h = 0; h < H; ++h) {
        const std::size_t to = (static_cast<std::size_t>(b) * H + h) * Nq + i;
        const std::size_t from = (static_cast<std::size_t>(h) * B + b) * Nq + i;
        if (args.lse_out != nullptr) args.lse_out[to] = args.lse[from];
        if (args.entropy_out != nullptr) args.entropy_out[to] = args.entropy[from];
      }
    }
  });
}

}  // namespace

template <class T, class Out>
void launch_tc_project(const T* weights, TcWeights layout, const T* x, Out* out, int heads,
                       int rows, int dim, int rank, cudaStream_t stream, const char* operation,
                       const TcRotary& rotary) {
  launch(operation, "project_kernel", project_kernel<T, Out>,
         grid_for(std::int64_t{heads} * rows * rank), kElementwiseThreads, 0, stream, weights,
         layout == TcWeights::transposed, x, out, heads, rows, dim, rank, rotary);
}

template <class T>
void launch_tc_combine(const TcCombineArgs& args, const T* up, const T* offset, T* update,
                       cudaStream_t stream, const char* operation) {
  launch(operation, "combine_kernel", combine_kernel<T>,
         grid_for(std::int64_t{args.batch} * args.queries * args.dim), kElementwiseThreads, 0,
         stream, args, up, offset, update);
}

#define EMFLOW_INSTANTIATE(T)                                                                     \
  template void launch_tc_project<T, T>(const T*, TcWeights, const T*, T*, int, int, int, int,    \
                                        cudaStream_t, const char*, const TcRotary&);              \
  template void launch_tc_project<T, float>(const T*, TcWeights, const T*, float*, int, int, int, \
                                            int, cudaStream_t, const char*, const TcRotary&);     \
  template void launch_tc_combine<T>(const TcCombineArgs&, const T*, const T*, T*, cudaStream_t,  \
                                     const char*);
EMFLOW_INSTANTIATE(bfloat16)
EMFLOW_INSTANTIATE(float16)
#undef EMFLOW_INSTANTIATE
// float storage (TF32): the projections and the key bias terms are both float.
template void launch_tc_project<float, float>(const float*, TcWeights, const float*, float*, int,
                                              int, int, int, cudaStream_t, const char*,
                                              const TcRotary&);
template void launch_tc_combine<float>(const TcCombineArgs&, const float*, const float*, float*,
                                       cudaStream_t, const char*);

}  // namespace emflow::detail
