// The vector layer of the fast CPU backend: one float vector type whose width is the path's
// (target.hpp: AVX-512 16 lanes, AVX2 8; the generic path off x86-64 4), the register-blocked
// GEMM micro-kernel the fused attention and its backward pass are built from, and a vectorised
// exp.
//
// Vec is a GCC/Clang vector type, so +, *, comparisons and ?: work on it directly; on x86 it is
// the intrinsic type itself. The generic path keeps a 4-lane generic vector, which the compiler
// lowers to whatever the target has, down to scalar code: the portable fallback.
//
// Only the paths' files (src/cpu) include this header. (src/tools/measure.cpp, the FMA peak of
// `emflow bench`, keeps a vector of its own of the same widths.)
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "target.hpp"

EMFLOW_CPU_BEGIN

#if EMFLOW_CPU_AVX512
#define EMFLOW_CPU_LANES 16
using Vec = __m512;
/// Vector registers the micro-kernel may use as accumulators (of 32).
inline constexpr int kAccumulators = 16;
#elif EMFLOW_CPU_AVX2
#define EMFLOW_CPU_LANES 8
using Vec = __m256;
inline constexpr int kAccumulators = 8;  // of 16
#else
#define EMFLOW_CPU_LANES 4
typedef float Vec __attribute__((vector_size(16)));
inline constexpr int kAccumulators = 8;
#endif

/// Integer lanes of the same width, for the exponent arithmetic of exp.
typedef std::int32_t VecInt __attribute__((vector_size(EMFLOW_CPU_LANES * 4)));

inline constexpr int kLanes = EMFLOW_CPU_LANES;

/// n rounded up to a whole number of vectors.
inline constexpr std::int64_t round_to_lanes(std::int64_t n) {
  return (n + kLanes - 1) / kLanes * kLanes;
}

inline Vec load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, Vec v) { std::memcpy(p, &v, sizeof v); }
inline Vec splat(float x) {
#if EMFLOW_CPU_AVX512
  return _mm512_set1_ps(x);
#elif EMFLOW_CPU_AVX2
  return _mm256_set1_ps(x);
#else
  Vec v;
  for (int i = 0; i < kLanes; ++i) v[i] = x;
  return v;
#endif
}

/// a * b + c with one rounding on the x86-64 paths (which all have FMA). (The build is ISO C++,
/// which turns off floating-point contraction, so a * b + c would never become an FMA by itself.)
inline Vec fma(Vec a, Vec b, Vec c) {
#if EMFLOW_CPU_AVX512
  return _mm512_fmadd_ps(a, b, c);
#elif EMFLOW_CPU_AVX2
  return _mm256_fmadd_ps(a, b, c);
#else
  return a * b + c;
#endif
}

inline Vec max(Vec a, Vec b) { return a > b ? a : b; }

/// True when some lane of a is greater than the same lane of b.
inline bool any_greater(Vec a, Vec b) {
#if EMFLOW_CPU_AVX512
  return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ) != 0;
#elif EMFLOW_CPU_AVX2
  return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_GT_OQ)) != 0;
#else
  for (int i = 0; i < kLanes; ++i) {
    if (a[i] > b[i]) return true;
  }
  return false;
#endif
}

inline float horizontal_max(Vec v) {
  float lanes[kLanes];
  store(lanes, v);
  for (int width = kLanes / 2; width >= 1; width /= 2) {
    for (int i = 0; i < width; ++i)
      lanes[i] = lanes[i + width] > lanes[i] ? lanes[i + width] : lanes[i];
  }
  return lanes[0];
}

/// Sum of the lanes in a fixed order (pairwise halving), so the result is reproducible.
inline float horizontal_sum(Vec v) {
  float lanes[kLanes];
  store(lanes, v);
  for (int width = kLanes / 2; width >= 1; width /= 2) {
    for (int i = 0; i < width; ++i) lanes[i] += lanes[i + width];
  }
  return lanes[0];
}

/// The constants of Cephes' expf, for exp_nonpositive below and for the AVX512-BF16 kernel's
/// exp (attend_bf16.cpp), which is compiled for its own target and cannot call this one: inputs
/// below kExpLowest give 0; x = n ln2 + r with ln2 = kExpLn2High + kExpLn2Low in two parts so
/// that n ln2 is exact; exp(r) = 1 + r + r^2 P(r), the coefficients of P highest first.
inline constexpr float kExpLowest = -87.33654f;
inline constexpr float kExpLog2e = 1.44269504088896341f;
inline constexpr float kExpLn2High = 0.693359375f;
inline constexpr float kExpLn2Low = -2.12194440e-4f;
inline constexpr int kExpTerms = 6;
inline constexpr float kExpPolynomial[kExpTerms] = {1.9875691500e-4f, 1.3981999507e-3f,
                                                    8.3334519073e-3f, 4.1665795894e-2f,
                                                    1.6666665459e-1f, 5.0000001201e-1f};

/// exp(x) for x <= 0, including -inf; results below FLT_MIN (x < -87.3) are flushed to 0, so a
/// masked score gives a weight of exactly 0. Cephes' expf: x = n ln2 + r with |r| <= ln2 / 2,
/// exp(r) by a degree-7 polynomial, 2^n built in the exponent bits. Relative error ~2 ulp.
inline Vec exp_nonpositive(Vec x) {
  const Vec lowest = splat(kExpLowest);
  const Vec xc = x < lowest ? lowest : x;
  // Round x / ln2 to the nearest integer with the 1.5 * 2^23 trick (exact for |t| < 2^22).
  const Vec magic = splat(12582912.0f);
  const Vec n = (xc * splat(kExpLog2e) + magic) - magic;
  Vec r = fma(n, splat(-kExpLn2High), xc);
  r = fma(n, splat(-kExpLn2Low), r);
  Vec p = splat(kExpPolynomial[0]);
  for (int i = 1; i < kExpTerms; ++i) p = fma(p, r, splat(kExpPolynomial[i]));
  p = fma(p, r * r, r) + splat(1.0f);
  const VecInt exponent = (__builtin_convertvector(n, VecInt) + 127) << 23;
  const Vec scale = (Vec)exponent;  // the same bits read as floats
  const Vec result = p * scale;
  return x < lowest ? Vec{} : result;
}

/// Makes the compiler hold v in a vector register from here on, so that the micro-kernel's FMAs
/// read B from registers. Left alone, GCC folds each use of B into the FMA as a memory operand:
/// then every k step of a 4 x 2 kernel issues 12 loads (4 broadcasts of A, 8 of B) for 8 FMAs,
/// more than the load ports of an AVX2 core serve in the 4 cycles the FMAs take (Zen 3: 46 of
/// 102 GFLOP/s in an L1-resident loop, 95 with B in registers; docs/PERF.md). The empty asm emits
/// nothing. AVX-512 builds keep the compiler's choice: not yet measured there.
inline void keep_in_register([[maybe_unused]] Vec& v) {
#if EMFLOW_CPU_AVX2 && !EMFLOW_CPU_AVX512
  asm("" : "+x"(v));
#endif
}

/// Register-blocked micro-kernel: C[MR x NV*kLanes] (+)= A[MR x K] B[K x NV*kLanes].
/// A is read one scalar at a time (broadcast), B one row of NV vectors at a time; the MR x NV
/// accumulators stay in registers for the whole K loop, as in a GEMM micro-kernel.
/// A's element (r, k) is A[r * lda + k], or A[k * lda + r] with kTransposedA (A stored as its
/// transpose: the columns of a row-major tile serve as the rows, as in P^T dO).
template <int MR, int NV, bool kTransposedA = false>
inline void micro_kernel(std::int64_t K, const float* A, std::int64_t lda, const float* B,
                         std::int64_t ldb, float* C, std::int64_t ldc, bool accumulate) {
  Vec acc[MR][NV];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) acc[r][v] = accumulate ? load(C + r * ldc + v * kLanes) : Vec{};
  }
  for (std::int64_t k = 0; k < K; ++k) {
    const float* b = B + k * ldb;
    Vec bk[NV];
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) {
      bk[v] = load(b + v * kLanes);
      keep_in_register(bk[v]);
    }
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const Vec a = splat(kTransposedA ? A[k * lda + r] : A[r * lda + k]);
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) acc[r][v] = fma(a, bk[v], acc[r][v]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) store(C + r * ldc + v * kLanes, acc[r][v]);
  }
}

/// The widest micro-kernel of MR rows that fits the accumulator registers.
inline constexpr int max_vectors(int rows) {
  return kAccumulators / rows > 0 ? kAccumulators / rows : 1;
}

template <int MR, int NV, bool kTransposedA = false>
inline void micro_kernel_remainder(std::int64_t vectors, std::int64_t K, const float* A,
                                   std::int64_t lda, const float* B, std::int64_t ldb, float* C,
                                   std::int64_t ldc, bool accumulate) {
  if constexpr (NV >= 1) {
    if (vectors == NV) {
      micro_kernel<MR, NV, kTransposedA>(K, A, lda, B, ldb, C, ldc, accumulate);
    } else {
      micro_kernel_remainder<MR, NV - 1, kTransposedA>(vectors, K, A, lda, B, ldb, C, ldc,
                                                       accumulate);
    }
  }
}

/// C[MR x columns] (+)= A[MR x K] B[K x columns] for `columns` a multiple of kLanes, as strips
/// of the widest micro-kernel and one narrower strip for the remainder; A as for micro_kernel.
/// Not inlined: inside a large caller GCC runs short of general registers and spills the
/// micro-kernel's operands; a call costs nothing next to the K x MR x columns FMAs.
template <int MR, bool kTransposedA = false>
__attribute__((noinline)) void row_block_gemm(std::int64_t K, const float* A, std::int64_t lda,
                                              const float* B, std::int64_t ldb,
                                              std::int64_t columns, float* C, std::int64_t ldc,
                                              bool accumulate) {
  constexpr int kWidest = max_vectors(MR);
  const std::int64_t vectors = columns / kLanes;
  std::int64_t v = 0;
  for (; v + kWidest <= vectors; v += kWidest) {
    micro_kernel<MR, kWidest, kTransposedA>(K, A, lda, B + v * kLanes, ldb, C + v * kLanes, ldc,
                                            accumulate);
  }
  if (v < vectors) {
    micro_kernel_remainder<MR, kWidest - 1, kTransposedA>(vectors - v, K, A, lda, B + v * kLanes,
                                                          ldb, C + v * kLanes, ldc, accumulate);
  }
}

EMFLOW_CPU_END
