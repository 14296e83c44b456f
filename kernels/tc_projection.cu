// The projections and the sum over heads of the 16-bit tensor-core paths (tc_projection.hpp).
// Plain element-wise products: d and the rank are small next to N, and the attention dominates
// from a few hundred tokens on.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "attend_plan.hpp"
#include "core/check.hpp"
#include "core/low_precision.hpp"
#include "emflow/precision.hpp"
#include "launch.cuh"
#include "tc_projection.hpp"

namespace emflow::detail {

namespace {

__device__ __forceinline__ void store(bfloat16* p, float v) { *p = to_bfloat16(v); }
__device__ __forceinline__ void store(float16* p, float v) { *p = to_float16(v); }
__device__ __forceinline__ void store(float* p, float v) { *p = v; }

template <class T, class Out>
__global__ void project_kernel(const T* weights, bool transposed, const T* x, Out* out, int heads,
                               int rows, int dim, int rank) {
  const std::size_t total = static_cast<std::size_t>(heads) * rows * rank;
  for (std::size_t index = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
       index < total; index += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const int c = static_cast<int>(index % rank);
    const std::size_t head_row = index / rank;
    const int row = static_cast<int>(head_row % rows);
    const int h = static_cast<int>(head_row / rows);
    const T* const xr = x + static_cast<std::size_t>(row) * dim;
    float sum = 0.f;
    if (transposed) {
      const T* const w = weights + static_cast<std::size_t>(h) * dim * rank + c;
      for (int k = 0; k < dim; ++k) {
        sum += to_float(w[static_cast<std::size_t>(k) * rank]) * to_float(xr[k]);
      }
    } else {
      const T* const w = weights + (static_cast<std::size_t>(h) * rank + c) * dim;
      for (int k = 0; k < dim; ++k) sum += to_float(w[k]) * to_float(xr[k]);
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
          for (int c = 0; c < r; ++c) sum += to_float(u[c]) * o[c];
        }
      }
      if (offset != nullptr) sum += to_float(offset[a]);
    }
    store(update + index, sum);
    if (a == 0 && args.lse_out != nullptr) {
      for (int h = 0; h < H; ++h) {
        args.lse_out[(static_cast<std::size_t>(b) * H + h) * Nq + i] =
            args.lse[(static_cast<std::size_t>(h) * B + b) * Nq + i];
      }
    }
  });
}

}  // namespace

template <class T, class Out>
void launch_tc_project(const T* weights, TcWeights layout, const T* x, Out* out, int heads,
                       int rows, int dim, int rank, cudaStream_t stream, const char* operation) {
  launch(operation, "project_kernel", project_kernel<T, Out>,
         grid_for(std::int64_t{heads} * rows * rank), kElementwiseThreads, 0, stream, weights,
         layout == TcWeights::transposed, x, out, heads, rows, dim, rank);
}

template <class T>
void launch_tc_combine(const TcCombineArgs& args, const T* up, const T* offset, T* update,
                       cudaStream_t stream, const char* operation) {
  launch(operation, "combine_kernel", combine_kernel<T>,
         grid_for(std::int64_t{args.batch} * args.queries * args.dim), kElementwiseThreads, 0,
         stream, args, up, offset, update);
}

std::size_t tc_aligned_bytes(std::size_t bytes) {
  return (bytes + kWorkspaceAlignment - 1) / kWorkspaceAlignment * kWorkspaceAlignment;
}

template <class T>
void check_tc_outputs(const AttentionOutput<T>& output, const char* operation) {
  if (const char* missing = tensor_core_missing_output(output.entropy, output.weights)) {
    fail(ErrorCode::unsupported, operation, ": output '", missing,
         "' is not computed by the tensor-core path (leave it null, or use device 'cpu')");
  }
}

#define EMFLOW_INSTANTIATE(T)                                                                     \
  template void launch_tc_project<T, T>(const T*, TcWeights, const T*, T*, int, int, int, int,    \
                                        cudaStream_t, const char*);                               \
  template void launch_tc_project<T, float>(const T*, TcWeights, const T*, float*, int, int, int, \
                                            int, cudaStream_t, const char*);                      \
  template void launch_tc_combine<T>(const TcCombineArgs&, const T*, const T*, T*, cudaStream_t,  \
                                     const char*);                                                \
  template void check_tc_outputs<T>(const AttentionOutput<T>&, const char*);
EMFLOW_INSTANTIATE(bfloat16)
EMFLOW_INSTANTIATE(float16)
#undef EMFLOW_INSTANTIATE

}  // namespace emflow::detail
