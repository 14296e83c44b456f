// Every tensor-core matrix multiply-accumulate and fragment load of the kernels, in one place:
//
//   mma_16816<T>(d, a, b)  d += a b, a 16 x 16 (row), b 16 x 8 (col), T = bfloat16 or float16:
//                          mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32
//   mma_1688_tf32(d, a, b) d += a b, a 16 x 8, b 8 x 8, TF32 operands:
//                          mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32
//
// accumulators_to_a (16-bit) and accumulator_to_a_tf32 turn score accumulators into the A
// operand of the next product in registers; for TF32 that permutes the keys of each 8-key chunk,
// and load_b_pairs_tf32 loads the values' B operand in the same order.
//
// with float32 accumulators. Two implementations behind this interface: the inline PTX on a
// device of compute capability 8.0 or later, and under EMFLOW_CUDA_EMULATION a software model of
// the instruction built from the fragment layouts of the PTX ISA ("Matrix Fragments for
// mma.m16n8k16 with floating point type", "... mma.m16n8k8 ... .tf32"). With g = lane / 4 and
// t = lane % 4 (the ISA's groupID and threadID_in_group), a lane holds
//
//   A (16 x 16, 16-bit; 4 registers of two values, the lower-indexed value in the low half):
//     x[0] = A[g][2t, 2t+1]   x[1] = A[g+8][2t, 2t+1]   x[2] = A[g][2t+8, 2t+9]
//     x[3] = A[g+8][2t+8, 2t+9]
//   B (16 x 8, 16-bit): x[0] = B[2t, 2t+1][g]   x[1] = B[2t+8, 2t+9][g]
//   A (16 x 8, TF32):  x[0] = A[g][t]   x[1] = A[g+8][t]   x[2] = A[g][t+4]   x[3] = A[g+8][t+4]
//   B (8 x 8, TF32):   x[0] = B[t][g]   x[1] = B[t+4][g]
//   C, D (16 x 8, f32): x[0] = C[g][2t]  x[1] = C[g][2t+1]  x[2] = C[g+8][2t]  x[3] = C[g+8][2t+1]
//
// The model needs the fragments of the whole warp: each lane writes its registers to a per-warp
// exchange area, one full-warp shuffle is the rendezvous (the emulation checks there that all 32
// lanes take part, as .aligned requires), and each lane then forms its own four outputs: the
// products of the 16-bit (or TF32) values, exact in float32, added to the accumulator in float32
// in order of k. The hardware adds the products in an order (and with an internal precision) of
// its own, so results may differ from the model in the last bits; a layout mismatch is gross.
// The exchange area is double-buffered by the parity of the lane's MMA count: a lane can run one
// MMA ahead of the slowest lane of its warp, never two (the next rendezvous waits for it).
//
// The fragment loads are plain 32-bit (16-bit pairs) or float loads of shared or global memory,
// the same code on the device and in the emulation; ldmatrix is a tuning candidate.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "emflow/precision.hpp"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "kernels/mma.cuh needs compute capability 8.0 or later (mma.sync with bf16 and tf32)"
#endif

namespace emflow::detail::mma {

/// A operand: 16 x 16 of 16-bit values, or 16 x 8 of TF32.
struct FragA {
  std::uint32_t x[4];
};
/// B operand: 16 x 8 of 16-bit values, or 8 x 8 of TF32.
struct FragB {
  std::uint32_t x[2];
};
/// C and D: 16 x 8 of float.
struct FragC {
  float x[4];
};

__device__ __forceinline__ int lane_id() { return static_cast<int>(threadIdx.x) & 31; }
__device__ __forceinline__ int lane_group() { return lane_id() >> 2; }    // g: 0..7
__device__ __forceinline__ int lane_in_group() { return lane_id() & 3; }  // t: 0..3

template <class T>
__device__ __forceinline__ std::uint16_t bits_of(float value);
template <>
__device__ __forceinline__ std::uint16_t bits_of<bfloat16>(float value) {
  return to_bfloat16(value).bits;
}
template <>
__device__ __forceinline__ std::uint16_t bits_of<float16>(float value) {
  return to_float16(value).bits;
}

/// Two floats rounded to T, packed as one register (lo in the low half).
template <class T>
__device__ __forceinline__ std::uint32_t pack(float lo, float hi) {
  return static_cast<std::uint32_t>(bits_of<T>(lo)) |
         (static_cast<std::uint32_t>(bits_of<T>(hi)) << 16);
}

/// The 16-bit pair at p (4-byte aligned): p[0] in the low half.
template <class T>
__device__ __forceinline__ std::uint32_t load_pair(const T* p) {
#if defined(__CUDA_ARCH__)
  return *reinterpret_cast<const std::uint32_t*>(p);
#else
  std::uint32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
#endif
}

/// A 16 x 16 A tile, row-major at `base` with `ld` elements a row (ld even, base 4-byte aligned).
template <class T>
__device__ __forceinline__ FragA load_a(const T* base, int ld) {
  const int g = lane_group(), t = lane_in_group();
  FragA a;
  a.x[0] = load_pair(base + g * ld + 2 * t);
  a.x[1] = load_pair(base + (g + 8) * ld + 2 * t);
  a.x[2] = load_pair(base + g * ld + 2 * t + 8);
  a.x[3] = load_pair(base + (g + 8) * ld + 2 * t + 8);
  return a;
}

/// A 16 x 8 B tile stored column-major: B[k][n] at base[n * ld + k] (a row-major n x k matrix,
/// as the keys are for Q K^T).
template <class T>
__device__ __forceinline__ FragB load_b_col(const T* base, int ld) {
  const int g = lane_group(), t = lane_in_group();
  FragB b;
  b.x[0] = load_pair(base + g * ld + 2 * t);
  b.x[1] = load_pair(base + g * ld + 2 * t + 8);
  return b;
}

/// A 16 x 8 TF32 A tile from row-major floats, each rounded to TF32 (cvt.rna).
__device__ __forceinline__ FragA load_a_tf32(const float* base, int ld) {
  const int g = lane_group(), t = lane_in_group();
  const float v[4] = {base[g * ld + t], base[(g + 8) * ld + t], base[g * ld + t + 4],
                      base[(g + 8) * ld + t + 4]};
  FragA a;
  for (int r = 0; r < 4; ++r) a.x[r] = detail::float_bits(round_to_tf32(v[r]));
  return a;
}

/// An 8 x 8 TF32 B tile stored column-major (B[k][n] at base[n * ld + k]), rounded to TF32.
__device__ __forceinline__ FragB load_b_col_tf32(const float* base, int ld) {
  const int g = lane_group(), t = lane_in_group();
  FragB b;
  b.x[0] = detail::float_bits(round_to_tf32(base[g * ld + t]));
  b.x[1] = detail::float_bits(round_to_tf32(base[g * ld + t + 4]));
  return b;
}

/// The A operand (16 x 8, TF32) made of one accumulator tile, with the 8 columns permuted:
/// A column t is C column 2t and A column t + 4 is C column 2t + 1, the values the lane holds
/// already (the accumulators hold columns 2t, 2t + 1, the A registers want t, t + 4). A product
/// with a B operand whose rows are permuted the same way (load_b_pairs_tf32) is the product of
/// the tiles as they are: the keys of an 8-key chunk are summed in another order.
__device__ __forceinline__ FragA accumulator_to_a_tf32(const FragC& c) {
  FragA a;
  a.x[0] = detail::float_bits(round_to_tf32(c.x[0]));  // A[g][t]       = C[g][2t]
  a.x[1] = detail::float_bits(round_to_tf32(c.x[2]));  // A[g + 8][t]   = C[g + 8][2t]
  a.x[2] = detail::float_bits(round_to_tf32(c.x[1]));  // A[g][t + 4]   = C[g][2t + 1]
  a.x[3] = detail::float_bits(round_to_tf32(c.x[3]));  // A[g + 8][t + 4] = C[g + 8][2t + 1]
  return a;
}

/// An 8 x 8 TF32 B tile from row-major floats (row k at base + k * ld) with the rows in the order
/// of accumulator_to_a_tf32: B row t is stored row 2t, B row t + 4 stored row 2t + 1.
__device__ __forceinline__ FragB load_b_pairs_tf32(const float* base, int ld) {
  const int g = lane_group(), t = lane_in_group();
  FragB b;
  b.x[0] = detail::float_bits(round_to_tf32(base[2 * t * ld + g]));
  b.x[1] = detail::float_bits(round_to_tf32(base[(2 * t + 1) * ld + g]));
  return b;
}

/// C tile (16 x 8) to row-major floats.
__device__ __forceinline__ void store_c(const FragC& c, float* base, int ld) {
  const int g = lane_group(), t = lane_in_group();
  base[g * ld + 2 * t] = c.x[0];
  base[g * ld + 2 * t + 1] = c.x[1];
  base[(g + 8) * ld + 2 * t] = c.x[2];
  base[(g + 8) * ld + 2 * t + 1] = c.x[3];
}

/// C tile (16 x 8) from row-major floats.
__device__ __forceinline__ FragC load_c(const float* base, int ld) {
  const int g = lane_group(), t = lane_in_group();
  FragC c;
  c.x[0] = base[g * ld + 2 * t];
  c.x[1] = base[g * ld + 2 * t + 1];
  c.x[2] = base[(g + 8) * ld + 2 * t];
  c.x[3] = base[(g + 8) * ld + 2 * t + 1];
  return c;
}

/// The A operand (16 x 16) made of two accumulator tiles side by side, columns 0..7 (`left`) and
/// 8..15 (`right`), rounded to T: the lane already holds exactly the values its A registers
/// need, so scores become the probabilities of the next product without leaving registers.
template <class T>
__device__ __forceinline__ FragA accumulators_to_a(const FragC& left, const FragC& right) {
  FragA a;
  a.x[0] = pack<T>(left.x[0], left.x[1]);
  a.x[1] = pack<T>(left.x[2], left.x[3]);
  a.x[2] = pack<T>(right.x[0], right.x[1]);
  a.x[3] = pack<T>(right.x[2], right.x[3]);
  return a;
}

#if defined(EMFLOW_CUDA_EMULATION)
namespace model {

enum class Kind { bf16, f16, tf32 };

struct Exchange {
  std::uint32_t a[32][4];
  std::uint32_t b[32][2];
};
inline Exchange exchange[32][2];  // by warp of the block (blocks run one at a time), by parity
inline thread_local unsigned parity = 0;  // threads are fresh at every launch

inline float element(Kind kind, std::uint32_t reg, int half) {
  const std::uint16_t bits = static_cast<std::uint16_t>(half ? reg >> 16 : reg & 0xffffu);
  if (kind == Kind::bf16) return to_float(bfloat16{bits});
  if (kind == Kind::f16) return to_float(float16{bits});
  // TF32 reads the upper 19 bits of the register; the rest is ignored.
  return detail::bits_float(reg & 0xffffe000u);
}

inline void run(Kind kind, FragC& d, const FragA& a, const FragB& b) {
  const int lane = lane_id(), warp = static_cast<int>(threadIdx.x) >> 5;
  Exchange& area = exchange[warp][parity];
  parity ^= 1u;
  for (int r = 0; r < 4; ++r) area.a[lane][r] = a.x[r];
  for (int r = 0; r < 2; ++r) area.b[lane][r] = b.x[r];
  (void)__shfl_xor_sync(0xffffffffu, 0, 1);  // the whole warp's fragments are in place
  const int g = lane >> 2, t = lane & 3;
  const bool tf32 = kind == Kind::tf32;
  const int depth = tf32 ? 8 : 16;
  for (int e = 0; e < 4; ++e) {
    const int row = g + (e >= 2 ? 8 : 0);
    const int col = 2 * t + (e & 1);
    float sum = d.x[e];
    for (int k = 0; k < depth; ++k) {
      float x, y;
      if (tf32) {
        x = element(kind, area.a[(row % 8) * 4 + k % 4][(row >= 8) + 2 * (k >= 4)], 0);
        y = element(kind, area.b[col * 4 + k % 4][k >= 4], 0);
      } else {
        x = element(kind, area.a[(row % 8) * 4 + (k % 8) / 2][(row >= 8) + 2 * (k >= 8)], k & 1);
        y = element(kind, area.b[col * 4 + (k % 8) / 2][k >= 8], k & 1);
      }
      sum += x * y;  // the product is exact in float
    }
    d.x[e] = sum;
  }
}

}  // namespace model
#endif

// One instruction: the model under the emulation, the PTX on the device (the operand list is
// the same for the three shapes: 4 accumulators, 4 A and 2 B registers).
#if defined(EMFLOW_CUDA_EMULATION)
#define EMFLOW_MMA_SYNC(kind, instruction) model::run(model::Kind::kind, d, a, b)
#elif defined(__CUDA_ARCH__)
#define EMFLOW_MMA_SYNC(kind, instruction)                                                      \
  asm volatile(instruction " {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n" \
               : "+f"(d.x[0]), "+f"(d.x[1]), "+f"(d.x[2]), "+f"(d.x[3])                         \
               : "r"(a.x[0]), "r"(a.x[1]), "r"(a.x[2]), "r"(a.x[3]), "r"(b.x[0]), "r"(b.x[1]))
#else
#define EMFLOW_MMA_SYNC(kind, instruction) ((void)d, (void)a, (void)b)
#endif

template <class T>
__device__ __forceinline__ void mma_16816(FragC& d, const FragA& a, const FragB& b);

template <>
__device__ __forceinline__ void mma_16816<bfloat16>(FragC& d, const FragA& a, const FragB& b) {
  EMFLOW_MMA_SYNC(bf16, "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32");
}

template <>
__device__ __forceinline__ void mma_16816<float16>(FragC& d, const FragA& a, const FragB& b) {
  EMFLOW_MMA_SYNC(f16, "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32");
}

__device__ __forceinline__ void mma_1688_tf32(FragC& d, const FragA& a, const FragB& b) {
  EMFLOW_MMA_SYNC(tf32, "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32");
}

#undef EMFLOW_MMA_SYNC

}  // namespace emflow::detail::mma
