// The checks of the MMA layer (kernels/mma.cuh): one warp, one instruction, fragments loaded and
// stored by the layer's own helpers, so a test can compare with a plain matrix product and catch
// a layout that differs from the hardware's (or from the emulation's model of it); and one warp
// of ldmatrix and cp.async, whose registers and bytes a test compares with the PTX ISA's layout.
#include <cuda_runtime.h>

#include <cstdint>

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

// The shared-memory loads: one warp brings the 32 x 32 tile of 16-bit values and the 16 x 16
// tile of floats into shared memory (rows padded to 40 and 20 elements, 80 bytes) by 16-byte
// cp.async, then writes per lane the registers launch_fragment_load_check lists.
constexpr int kHalfLd = 40, kFloatLd = 20;

__global__ void fragment_load_check_kernel(const std::uint16_t* halves, const float* floats,
                                           std::uint32_t* out) {
  EMFLOW_DYNAMIC_SHARED(storage);
  auto* const h = reinterpret_cast<std::uint16_t*>(storage);
  float* const f = reinterpret_cast<float*>(h + 32 * kHalfLd);
  const int lane = static_cast<int>(threadIdx.x);
  for (int chunk = lane; chunk < 32 * 4; chunk += 32) {  // 4 copies of 8 halves a row
    const int r = chunk / 4, c = 8 * (chunk % 4);
    mma::cp_async<16>(h + r * kHalfLd + c, halves + r * 32 + c, 16);
  }
  for (int chunk = lane; chunk < 16 * 4; chunk += 32) {  // 4 copies of 4 floats a row
    const int r = chunk / 4, c = 4 * (chunk % 4);
    mma::cp_async<16>(f + r * kFloatLd + c, floats + r * 16 + c, 16);
  }
  mma::cp_async_commit();
  mma::cp_async_wait<0>();
  __syncthreads();

  std::uint32_t* const mine = out + lane * kFragmentLoadRegisters;
  std::uint32_t r[4];
  mma::ldmatrix_x4<false>(r, h + lane * kHalfLd);
  for (int i = 0; i < 4; ++i) mine[i] = r[i];
  mma::ldmatrix_x4<true>(r, h + lane * kHalfLd);
  for (int i = 0; i < 4; ++i) mine[4 + i] = r[i];
  const mma::FragA a = mma::load_a_ldsm(h, kHalfLd);
  for (int i = 0; i < 4; ++i) mine[8 + i] = a.x[i];
  mma::FragB first, second;
  mma::load_b_col_pair_ldsm(h, kHalfLd, first, second);
  mine[12] = first.x[0];
  mine[13] = first.x[1];
  mine[14] = second.x[0];
  mine[15] = second.x[1];
  mma::load_b_row_pair_ldsm(h, kHalfLd, first, second);
  mine[16] = first.x[0];
  mine[17] = first.x[1];
  mine[18] = second.x[0];
  mine[19] = second.x[1];
  const mma::FragA a32 = mma::load_a_tf32_ldsm(f, kFloatLd);
  for (int i = 0; i < 4; ++i) mine[20 + i] = a32.x[i];
  mma::load_b_col_pair_tf32_ldsm(f, kFloatLd, first, second);
  mine[24] = first.x[0];
  mine[25] = first.x[1];
  mine[26] = second.x[0];
  mine[27] = second.x[1];
}

// Asynchronous copies with every zero-fill length: lane i copies 16 bytes with i % 17 from the
// source, 4 with i % 5 and 8 with i % 9; the 16-byte copies are one group, the others a second.
// After waiting for the older group, each lane writes its own 16 bytes (visible to itself after
// the wait); after waiting for both and a barrier, lane i writes the 4- and 8-byte regions of
// lane 31 - i (visible to the block after the barrier).
__global__ void async_copy_check_kernel(const unsigned char* src, unsigned char* out) {
  EMFLOW_DYNAMIC_SHARED(storage);
  auto* const bytes = reinterpret_cast<unsigned char*>(storage);
  const int i = static_cast<int>(threadIdx.x);
  mma::cp_async<16>(bytes + 16 * i, src + 16 * i, i % 17);
  mma::cp_async_commit();
  mma::cp_async<4>(bytes + 512 + 4 * i, src + 512 + 4 * i, i % 5);
  mma::cp_async<8>(bytes + 640 + 8 * i, src + 640 + 8 * i, i % 9);
  mma::cp_async_commit();
  mma::cp_async_wait<1>();
  for (int b = 0; b < 16; ++b) out[16 * i + b] = bytes[16 * i + b];
  mma::cp_async_wait<0>();
  __syncthreads();
  const int other = 31 - i;
  for (int b = 0; b < 4; ++b) out[512 + 4 * other + b] = bytes[512 + 4 * other + b];
  for (int b = 0; b < 8; ++b) out[640 + 8 * other + b] = bytes[640 + 8 * other + b];
}

}  // namespace

void launch_fragment_load_check(const std::uint16_t* halves, const float* floats,
                                std::uint32_t* out, cudaStream_t stream, const char* operation) {
  const std::size_t shared =
      (32 * kHalfLd) * sizeof(std::uint16_t) + (16 * kFloatLd) * sizeof(float);
  launch(operation, "fragment_load_check_kernel", fragment_load_check_kernel, 1, 32, shared, stream,
         halves, floats, out);
}

void launch_async_copy_check(const unsigned char* src, unsigned char* out, cudaStream_t stream,
                             const char* operation) {
  launch(operation, "async_copy_check_kernel", async_copy_check_kernel, 1, 32, kAsyncCopyBytes,
         stream, src, out);
}

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
