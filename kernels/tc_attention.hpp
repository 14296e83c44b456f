// Launchers of the tensor-core kernels (kernels/mma.cuh): the check of the MMA layer
// (mma_check.cu). Each enqueues on `stream`, checks the launch, and never synchronises.
// Pointers are device pointers.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "attention_kernels.hpp"

namespace emflow::detail {

/// The instruction an MMA check runs (kernels/mma.cuh).
enum class MmaKind { bf16, f16, tf32 };

/// One warp computes d = a b + c with one instruction of `kind`. a: 16 x K row-major, b: K x 8
/// column-major (b[n * K + k]), c, d: 16 x 8 row-major floats; K = 16 for bf16 and f16 (a and b
/// hold bfloat16 or float16), 8 for tf32 (a and b hold floats, rounded to TF32 on load).
void launch_mma_check(MmaKind kind, const void* a, const void* b, const float* c, float* d,
                      cudaStream_t stream, const char* operation);

}  // namespace emflow::detail
