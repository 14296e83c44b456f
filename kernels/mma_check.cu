// The check of the MMA layer (kernels/mma.cuh): one warp, one instruction, fragments loaded and
// stored by the layer's own helpers, so a test can compare with a plain matrix product and catch
// a layout that differs from the hardware's (or from the emulation's model of it).
#include <cuda_runtime.h>

#include "emflow/precision.hpp"
#include "launch.cuh"
#include "mma.cuh"
#include "tc_attention.hpp"

namespace emflow::detail {

namespace {

template <class T>
__global__ void mma_check_kernel(const T* a, const T* b, const float* c, float* d) {
  mma::FragC acc = mma::load_c(c, 8);
  mma::mma_16816<T>(acc, mma::load_a(a, 16), mma::load_b_col(b, 16));
  mma::store_c(acc, d, 8);
}

__global__ void mma_check_tf32_kernel(const float* a, const float* b, const float* c, float* d) {
  mma::FragC acc = mma::load_c(c, 8);
  mma::mma_1688_tf32(acc, mma::load_a_tf32(a, 8), mma::load_b_col_tf32(b, 8));
  mma::store_c(acc, d, 8);
}

// a as an accumulator tile (the scores of 8 keys) and b as 8 rows of values, row-major: the
// operands of the attention's P V with their keys permuted the same way.
__global__ void mma_check_tf32_pairs_kernel(const float* a, const float* b, const float* c,
                                            float* d) {
  mma::FragC acc = mma::load_c(c, 8);
  mma::mma_1688_tf32(acc, mma::accumulator_to_a_tf32(mma::load_c(a, 8)),
                     mma::load_b_pairs_tf32(b, 8));
  mma::store_c(acc, d, 8);
}

}  // namespace

void launch_mma_check(MmaKind kind, const void* a, const void* b, const float* c, float* d,
                      cudaStream_t stream, const char* operation) {
  switch (kind) {
    case MmaKind::bf16:
      launch(operation, "mma_check_kernel", mma_check_kernel<bfloat16>, 1, 32, 0, stream,
             static_cast<const bfloat16*>(a), static_cast<const bfloat16*>(b), c, d);
      break;
    case MmaKind::f16:
      launch(operation, "mma_check_kernel", mma_check_kernel<float16>, 1, 32, 0, stream,
             static_cast<const float16*>(a), static_cast<const float16*>(b), c, d);
      break;
    case MmaKind::tf32:
      launch(operation, "mma_check_tf32_kernel", mma_check_tf32_kernel, 1, 32, 0, stream,
             static_cast<const float*>(a), static_cast<const float*>(b), c, d);
      break;
    case MmaKind::tf32_pairs:
      launch(operation, "mma_check_tf32_pairs_kernel", mma_check_tf32_pairs_kernel, 1, 32, 0,
             stream, static_cast<const float*>(a), static_cast<const float*>(b), c, d);
      break;
  }
}

}  // namespace emflow::detail
