// The GPU sweep of the phase diagram (phase_kernels.cu), called by phase_diagram
// (src/flow/phase.cpp). Compiled only with CUDA; callers guard with EMFLOW_WITH_CUDA.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "emflow/flow.hpp"

namespace emflow::flow::detail {

/// Bytes of dynamic shared memory one block of the GPU sweep needs for clouds of `tokens` tokens
/// in `dim` dimensions, at the fewest clouds per block (one); 0 when a cloud has more tokens than
/// a block has threads (1024). Needs no device.
std::size_t phase_kernel_cuda_shared_bytes(std::int64_t tokens, std::int64_t dim);

/// Whether the GPU sweep can run clouds of this size on the current device: one thread per
/// token, and one cloud's state in the block's shared memory (the device's opt-in limit).
/// When it cannot, phase_diagram falls back to the generic path on the device.
bool phase_kernel_cuda_fits(std::int64_t tokens, std::int64_t dim);

/// The phase sweep on the current CUDA device: the equations of the CPU sweep
/// (src/flow/sphere_kernel.cpp) in float32, one thread per token. initial: (C, N, d), the same
/// clouds for every beta; `steps` RK4 steps of length `step`, the last one `last_step`. Returns
/// the clustered fractions (S + 1, K), averaged over the C clouds. Blocks
/// until the result is on the host. progress, when given, is called with (steps done, steps)
/// between launches of a few steps each; without it the whole sweep is one launch.
std::vector<double> phase_kernel_cuda(const std::vector<float>& initial, std::int64_t clouds,
                                      std::int64_t tokens, std::int64_t dim,
                                      const std::vector<double>& betas, std::int64_t steps,
                                      double step, double last_step, double cluster_eps,
                                      const Progress& progress);

}  // namespace emflow::flow::detail
