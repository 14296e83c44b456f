// The projection kernel of the device decode cache (src/cuda/decode_cache.hpp).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace emflow::detail {

/// out[h * out_head_stride + r * dim + a] = scale (sum_k in[r, k] W_h[k, a] + bias[h, a]) for
/// `heads` maps W_h = map + h dim^2 (row-major dim x dim; `transposed`: W_h[k, a] read as
/// map_h[a, k], so the rows are mapped by map_h itself) and rows r < `rows` of `in` (rows x dim).
/// bias: (heads, dim) or null. Queries: Q M_h + u_h; contents: X F_h^T (transposed).
void launch_project_rows(const float* in, int rows, int dim, const float* map, bool transposed,
                         const float* bias, float scale, int heads, std::size_t out_head_stride,
                         float* out, cudaStream_t stream, const char* operation);

}  // namespace emflow::detail
