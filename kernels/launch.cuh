// How every kernel is launched, sized and given its dynamic shared memory: one spelling that
// nvcc compiles for the GPU and that the CPU emulation of CUDA (tests/cuda/emulation, built with
// EMFLOW_CUDA_EMULATION) compiles as ordinary C++.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <utility>

#include "cuda/cuda_support.hpp"

namespace emflow::detail {

/// Threads per block of the element-wise kernels.
constexpr int kElementwiseThreads = 256;

/// Blocks of `threads` threads for a grid-stride loop over `total` items: enough to cover them
/// (at least one), at most `max_blocks`; the loop strides over the rest.
inline unsigned grid_for(std::int64_t total, int threads = kElementwiseThreads,
                         unsigned max_blocks = 65535u) {
  const std::int64_t wanted = total / threads + (total % threads != 0 ? 1 : 0);
  if (wanted < 1) return 1u;
  return wanted < static_cast<std::int64_t>(max_blocks) ? static_cast<unsigned>(wanted)
                                                        : max_blocks;
}

/// The grid-stride loop of an element-wise kernel over a (batch, tokens, dim) array: calls
/// body(index, b, i, a) for every element, index = (b * tokens + i) * dim + a.
template <class Body>
__device__ __forceinline__ void for_each_token_element(int batch, int tokens, int dim, Body body) {
  const std::size_t per_cloud = static_cast<std::size_t>(tokens) * dim;
  const std::size_t total = per_cloud * batch;
  for (std::size_t index = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
       index < total; index += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const int b = static_cast<int>(index / per_cloud);
    const std::size_t within = index - static_cast<std::size_t>(b) * per_cloud;
    const int i = static_cast<int>(within / dim);
    const int a = static_cast<int>(within - static_cast<std::size_t>(i) * dim);
    body(index, b, i, a);
  }
}

/// Enqueues kernel<<<blocks, threads, shared_bytes, stream>>>(args...) and reports a failed
/// launch (check_launch) as an error of `operation` naming `name`. Never synchronises.
template <class... Params, class... Args>
void launch(const char* operation, const char* name, void (*kernel)(Params...), unsigned blocks,
            unsigned threads, std::size_t shared_bytes, cudaStream_t stream, Args&&... args) {
#if defined(EMFLOW_CUDA_EMULATION)
  emu_launch(name, kernel, blocks, threads, shared_bytes, stream, std::forward<Args>(args)...);
#else
  // clang-format off
  kernel<<<blocks, threads, shared_bytes, stream>>>(std::forward<Args>(args)...);
  // clang-format on
#endif
  check_launch(operation, name);
}

}  // namespace emflow::detail

/// Declares `name` as the block's dynamic shared memory, an array of float4 (16-byte aligned).
/// EMFLOW_SHARED(type, name, extents) declares static shared memory: `type name extents`, as
/// EMFLOW_SHARED(double, sums, [128]) for `__shared__ double sums[128]`. The CPU emulation
/// poisons both at every block start, as a GPU leaves them holding garbage.
#if defined(EMFLOW_CUDA_EMULATION)
#define EMFLOW_DYNAMIC_SHARED(name) float4* const name = emu_dynamic_shared()
#define EMFLOW_SHARED(type, name, extents)                            \
  static type name extents;                                           \
  [[maybe_unused]] static const bool name##_poisoned_at_block_start = \
      emu::register_static_shared(static_cast<void*>(&name), sizeof(name))
#else
#define EMFLOW_DYNAMIC_SHARED(name) extern __shared__ float4 name[]
#define EMFLOW_SHARED(type, name, extents) __shared__ type name extents
#endif
