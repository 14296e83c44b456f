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
// Fragment loads, two kinds. The plain ones (load_a, load_b_col, ...) are 32-bit (16-bit pairs)
// or float loads of shared or global memory, the same code on the device and in the emulation.
// The *_ldsm ones read shared memory with ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: four
// 8 x 8 matrices of 16-bit values, lane l giving the address of row l % 8 of matrix l / 8 (16
// bytes, 16-byte aligned); lane (g, t) receives in register i the pair (row g, columns 2t,
// 2t + 1) of matrix i, or with .trans the pair (rows 2t, 2t + 1, column g): the matrix
// transposed ("Warp-level matrix load instruction: ldmatrix" in the PTX ISA). One instruction
// gives a whole A operand, or the B operands of two 8-wide tiles, each lane reading 16 bytes
// where the plain loads read 4 (or 2); .trans reads B from a row-major tile (the values of P V),
// so no transposed copy is stored. An 8 x 8 b16 matrix is also 8 rows of 4 floats, and lane
// (g, t) receives float t of row g: the TF32 A and B (column) operands load the same way (the
// transposed TF32 B cannot: .trans moves 16-bit halves).
//
// Asynchronous copies: cp_async<Bytes>(dst, src, src_bytes) issues cp.async (.cg for 16 bytes,
// .ca for 4 and 8) of `Bytes` bytes from global to shared memory, the bytes past src_bytes
// filled with zeros (0: no read, all zeros); cp_async_commit closes the thread's copies issued
// since the last commit into a group; cp_async_wait<N> waits until at most the newest N groups
// of the thread are pending. A copy is visible to its own thread after the wait, to the block
// after a barrier that follows it.
//
// The emulation's models: ldmatrix exchanges the 32 row addresses through a per-warp area with
// the same full-warp rendezvous as the MMA (and checks alignment and that the rows lie in shared
// memory); cp.async is emu::AsyncCopies (tests/cuda/emulation/emu_block.h): the destination
// holds poison from the issue until the thread's wait for its group, when the bytes land.
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

// ldmatrix: the row addresses of the warp's 32 lanes, by warp and parity of the lane's count
// of ldmatrix (as the MMA's exchange below).
struct Rows {
  const unsigned char* row[32];
};
inline Rows rows[32][2];
// Each lane's counts of ldmatrix and of MMA, by parity (the exchange below), from 0 at every
// block (emu::block_serial). Kept per CUDA thread of the block, not per host thread: the
// emulation's CUDA threads take turns on one host thread (emu_block.h, Fibers).
struct Parities {
  unsigned rows = 0, mma = 0;
  unsigned long long block = ~0ull;
};
inline Parities parities_of[1024];
inline Parities& parities() {
  Parities& p = parities_of[threadIdx.x];
  if (p.block != emu::block_serial) p = Parities{0, 0, emu::block_serial};
  return p;
}

template <bool Trans>
inline void ldmatrix_x4(std::uint32_t (&r)[4], const void* row) {
  const int lane = lane_id(), warp = static_cast<int>(threadIdx.x) >> 5;
  if (reinterpret_cast<std::uintptr_t>(row) % 16 != 0) {
    emu::kernel_violation(emu::thread_name() + ": ldmatrix with a row address not 16-byte aligned");
  }
  if (!emu::in_shared(row, 16)) {
    emu::kernel_violation(emu::thread_name() + ": ldmatrix with a row outside shared memory");
  }
  Parities& p = parities();
  Rows& area = rows[warp][p.rows];
  p.rows ^= 1u;
  area.row[lane] = static_cast<const unsigned char*>(row);
  (void)__shfl_xor_sync(0xffffffffu, 0, 1);  // the whole warp's addresses are in place
  const int g = lane >> 2, t = lane & 3;
  for (int i = 0; i < 4; ++i) {
    if (Trans) {
      std::uint16_t lo, hi;  // column g of rows 2t and 2t + 1
      std::memcpy(&lo, area.row[8 * i + 2 * t] + 2 * g, 2);
      std::memcpy(&hi, area.row[8 * i + 2 * t + 1] + 2 * g, 2);
      r[i] = static_cast<std::uint32_t>(lo) | (static_cast<std::uint32_t>(hi) << 16);
    } else {
      std::memcpy(&r[i], area.row[8 * i + g] + 4 * t, 4);  // columns 2t, 2t + 1 of row g
    }
  }
}

struct Exchange {
  std::uint32_t a[32][4];
  std::uint32_t b[32][2];
};
inline Exchange exchange[32][2];  // by warp of the block (blocks run one at a time), by parity

inline float element(Kind kind, std::uint32_t reg, int half) {
  const std::uint16_t bits = static_cast<std::uint16_t>(half ? reg >> 16 : reg & 0xffffu);
  if (kind == Kind::bf16) return to_float(bfloat16{bits});
  if (kind == Kind::f16) return to_float(float16{bits});
  // TF32 reads the upper 19 bits of the register; the rest is ignored.
  return detail::bits_float(reg & 0xffffe000u);
}

inline void run(Kind kind, FragC& d, const FragA& a, const FragB& b) {
  const int lane = lane_id(), warp = static_cast<int>(threadIdx.x) >> 5;
  Parities& p = parities();
  Exchange& area = exchange[warp][p.mma];
  p.mma ^= 1u;
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

// --- ldmatrix --------------------------------------------------------------------------------

/// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16 (the layout above): `row` is this lane's
/// row address, row l % 8 of matrix l / 8. Every lane of the warp takes part.
template <bool Trans>
__device__ __forceinline__ void ldmatrix_x4(std::uint32_t (&r)[4], const void* row) {
#if defined(EMFLOW_CUDA_EMULATION)
  model::ldmatrix_x4<Trans>(r, row);
#elif defined(__CUDA_ARCH__)
  const auto address = static_cast<std::uint32_t>(__cvta_generic_to_shared(row));
  if constexpr (Trans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
  }
#else
  (void)row;
  r[0] = r[1] = r[2] = r[3] = 0;
#endif
}

/// A 16 x 16 A tile of 16-bit values, row-major at `base` (ld elements a row; rows 16-byte
/// aligned), by one ldmatrix: lane l gives row l % 16 at column 8 (l / 16), so matrices 0..3 are
/// the quarters (rows 0-7, 8-15) x (columns 0-7, 8-15) that registers x[0..3] hold.
template <class T>
__device__ __forceinline__ FragA load_a_ldsm(const T* base, int ld) {
  const int l = lane_id();
  FragA a;
  ldmatrix_x4<false>(a.x, base + (l % 16) * ld + 8 * (l / 16));
  return a;
}

/// A 16 x 16 A tile stored as its transpose, A[i][k] at base[k * ld + i] (rows of k, as dS^T is
/// held for dQ = dS K), by one ldmatrix.trans: lane l gives row (l % 8) + 8 (l / 16) at column
/// 8 ((l / 8) % 2), so that matrix m is the stored rows 8 (m / 2).. and columns 8 (m % 2)..,
/// transposed into register x[m]'s quarter of A.
template <class T>
__device__ __forceinline__ FragA load_a_trans_ldsm(const T* base, int ld) {
  const int l = lane_id();
  FragA a;
  ldmatrix_x4<true>(a.x, base + ((l % 8) + 8 * (l / 16)) * ld + 8 * ((l / 8) % 2));
  return a;
}

/// The B operands (16 x 8 each) of two 8-wide tiles stored column-major, B[k][n] at
/// base[n * ld + k] (rows of keys, as for Q K^T): `first` for n = 0..7, `second` for n = 8..15,
/// by one ldmatrix: lane l gives row (l % 8) + 8 (l / 16) at column 8 ((l / 8) % 2).
template <class T>
__device__ __forceinline__ void load_b_col_pair_ldsm(const T* base, int ld, FragB& first,
                                                     FragB& second) {
  const int l = lane_id();
  std::uint32_t r[4];
  ldmatrix_x4<false>(r, base + ((l % 8) + 8 * (l / 16)) * ld + 8 * ((l / 8) % 2));
  first.x[0] = r[0];
  first.x[1] = r[1];
  second.x[0] = r[2];
  second.x[1] = r[3];
}

/// The B operands (16 x 8 each) of two 8-wide tiles stored row-major, B[k][n] at base[k * ld + n]
/// (the values of P V, keys down the rows): `first` for columns n = 0..7, `second` for 8..15, by
/// one ldmatrix.trans: lane l gives row (l % 8) + 8 ((l / 8) % 2) at column 8 (l / 16).
template <class T>
__device__ __forceinline__ void load_b_row_pair_ldsm(const T* base, int ld, FragB& first,
                                                     FragB& second) {
  const int l = lane_id();
  std::uint32_t r[4];
  ldmatrix_x4<true>(r, base + ((l % 8) + 8 * ((l / 8) % 2)) * ld + 8 * (l / 16));
  first.x[0] = r[0];
  first.x[1] = r[1];
  second.x[0] = r[2];
  second.x[1] = r[3];
}

/// A 16 x 8 TF32 A tile from row-major floats (rows 16-byte aligned) by one ldmatrix, each value
/// rounded to TF32 (cvt.rna): lane l gives row (l % 8) + 8 ((l / 8) % 2) at float 4 (l / 16).
__device__ __forceinline__ FragA load_a_tf32_ldsm(const float* base, int ld) {
  const int l = lane_id();
  FragA a;
  ldmatrix_x4<false>(a.x, base + ((l % 8) + 8 * ((l / 8) % 2)) * ld + 4 * (l / 16));
  for (int r = 0; r < 4; ++r)
    a.x[r] = detail::float_bits(round_to_tf32(detail::bits_float(a.x[r])));
  return a;
}

/// The TF32 B operands (8 x 8 each) of two 8-wide tiles stored column-major (B[k][n] at
/// base[n * ld + k]), rounded to TF32: `first` for n = 0..7, `second` for 8..15, by one
/// ldmatrix: lane l gives row (l % 8) + 8 (l / 16) at float 4 ((l / 8) % 2).
__device__ __forceinline__ void load_b_col_pair_tf32_ldsm(const float* base, int ld, FragB& first,
                                                          FragB& second) {
  const int l = lane_id();
  std::uint32_t r[4];
  ldmatrix_x4<false>(r, base + ((l % 8) + 8 * (l / 16)) * ld + 4 * ((l / 8) % 2));
  for (std::uint32_t& v : r) v = detail::float_bits(round_to_tf32(detail::bits_float(v)));
  first.x[0] = r[0];
  first.x[1] = r[1];
  second.x[0] = r[2];
  second.x[1] = r[3];
}

// --- cp.async --------------------------------------------------------------------------------

/// Issues an asynchronous copy of `Bytes` (4, 8 or 16) bytes from global `src` to shared `dst`,
/// both aligned to `Bytes`; the bytes past `src_bytes` are zeros (src_bytes = 0 reads nothing).
template <int Bytes>
__device__ __forceinline__ void cp_async(void* dst, const void* src, int src_bytes) {
  static_assert(Bytes == 4 || Bytes == 8 || Bytes == 16, "cp.async copies 4, 8 or 16 bytes");
#if defined(EMFLOW_CUDA_EMULATION)
  emu::async_copies().issue(dst, src, Bytes, static_cast<unsigned>(src_bytes));
#elif defined(__CUDA_ARCH__)
  const auto address = static_cast<std::uint32_t>(__cvta_generic_to_shared(dst));
  if constexpr (Bytes == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(address), "l"(src),
                 "r"(src_bytes));
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(address), "l"(src),
                 "n"(Bytes), "r"(src_bytes));
  }
#else
  (void)dst;
  (void)src;
  (void)src_bytes;
#endif
}

/// Closes the copies this thread issued since the last commit into one group.
__device__ __forceinline__ void cp_async_commit() {
#if defined(EMFLOW_CUDA_EMULATION)
  emu::async_copies().commit();
#elif defined(__CUDA_ARCH__)
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}

/// Waits until at most the newest `Newest` committed groups of this thread are pending.
template <int Newest>
__device__ __forceinline__ void cp_async_wait() {
#if defined(EMFLOW_CUDA_EMULATION)
  emu::async_copies().wait(Newest);
#elif defined(__CUDA_ARCH__)
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Newest) : "memory");
#endif
}

}  // namespace emflow::detail::mma
