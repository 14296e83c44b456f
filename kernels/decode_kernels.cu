// The decode cache's projections: one thread per output element, a dot product of dim terms.
// They touch O(rows heads dim^2) flops for the few rows of an append or a query block, small
// against the attention over the whole cache, so they are kept simple.
#include <cuda_runtime.h>

#include <cstdint>

#include "decode_kernels.hpp"
#include "launch.cuh"

namespace emflow::detail {

namespace {

__global__ void project_rows_kernel(const float* __restrict__ in, int rows, int dim,
                                    const float* __restrict__ map, bool transposed,
                                    const float* __restrict__ bias, float scale, int heads,
                                    std::size_t out_head_stride, float* __restrict__ out) {
  const std::size_t per_head = static_cast<std::size_t>(rows) * dim;
  const std::size_t total = per_head * heads;
  for (std::size_t index = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
       index < total; index += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const int h = static_cast<int>(index / per_head);
    const std::size_t within = index - static_cast<std::size_t>(h) * per_head;
    const int r = static_cast<int>(within / dim);
    const int a = static_cast<int>(within - static_cast<std::size_t>(r) * dim);
    const float* w = map + static_cast<std::size_t>(h) * dim * dim;
    const float* x = in + static_cast<std::size_t>(r) * dim;
    float sum = bias != nullptr ? bias[static_cast<std::size_t>(h) * dim + a] : 0.f;
    for (int k = 0; k < dim; ++k) {
      sum = fmaf(x[k],
                 transposed ? w[static_cast<std::size_t>(a) * dim + k]
                            : w[static_cast<std::size_t>(k) * dim + a],
                 sum);
    }
    out[h * out_head_stride + within] = scale * sum;
  }
}

}  // namespace

void launch_project_rows(const float* in, int rows, int dim, const float* map, bool transposed,
                         const float* bias, float scale, int heads, std::size_t out_head_stride,
                         float* out, cudaStream_t stream, const char* operation) {
  const std::int64_t total = static_cast<std::int64_t>(rows) * dim * heads;
  launch(operation, "project_rows_kernel", project_rows_kernel, grid_for(total),
         kElementwiseThreads, 0, stream, in, rows, dim, map, transposed, bias, scale, heads,
         out_head_stride, out);
}

}  // namespace emflow::detail
