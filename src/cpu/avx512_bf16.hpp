// What the AVX512-BF16 kernels share (attend_bf16.cpp, sdpa_backward_bf16.cpp,
// products_bf16.cpp): the float32 exp of their softmax and the register-blocked vdpbf16ps
// micro-kernel of their products. All of them exist on the avx512bf16 path only (target.hpp),
// which dispatch.cpp takes where the processor has AVX512-BF16.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "emflow/precision.hpp"
#include "simd.hpp"
#include "target.hpp"

#if EMFLOW_CPU_AVX512BF16  // the avx512bf16 path only

EMFLOW_CPU_BEGIN

/// exp(x) for x <= 0 (and -inf, giving 0): exp_nonpositive of simd.hpp with its constants, in
/// AVX-512 intrinsics for the AVX512-BF16 target.
inline __m512 exp_nonpositive_avx512(__m512 x) {
  const __m512 lowest = _mm512_set1_ps(kExpLowest);
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, lowest, _CMP_LT_OQ);
  const __m512 xc = _mm512_max_ps(x, lowest);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(kExpLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kExpLn2High), xc);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kExpLn2Low), r);
  __m512 p = _mm512_set1_ps(kExpPolynomial[0]);
  for (int i = 1; i < kExpTerms; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPolynomial[i]));
  p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  const __m512i e =
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  const __m512 result = _mm512_mul_ps(p, _mm512_castsi512_ps(e));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~tiny), result);
}

/// Two bfloat16 values side by side, as vdpbf16ps pairs them.
using Word = std::uint32_t;

/// The word holding the bfloat16 roundings of `low` (bits 0-15) and `high` (bits 16-31).
inline Word pair_of(float low, float high) {
  return static_cast<Word>(to_bfloat16(low).bits) | static_cast<Word>(to_bfloat16(high).bits) << 16;
}

/// C[R x 16 NV] (+)= A[R x K] B[K x 16 NV] over K pairs by vdpbf16ps: A's word (m, k) is
/// A[m * lda + k], or A[k * lda + m] with kTransposedA; B's row k of words (a pair of bfloat16
/// for each of 16 NV columns) is B + k * ldb.
template <int R, int NV, bool kTransposedA, bool kAccumulate>
inline void dp_kernel(std::int64_t K, const Word* A, std::int64_t lda, const Word* B,
                      std::int64_t ldb, float* C, std::int64_t ldc) {
  // Fully unrolled, so that the accumulators live in registers from the first load to the last
  // store (left to itself GCC keeps the array on the stack outside the K loop).
  __m512 acc[R][NV];
#pragma GCC unroll 16
  for (int m = 0; m < R; ++m) {
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) {
      acc[m][v] = kAccumulate ? _mm512_loadu_ps(C + m * ldc + v * 16) : _mm512_setzero_ps();
    }
  }
  for (std::int64_t k = 0; k < K; ++k) {
    __m512bh b[NV];
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) b[v] = (__m512bh)_mm512_loadu_si512(B + k * ldb + v * 16);
#pragma GCC unroll 16
    for (int m = 0; m < R; ++m) {
      const Word word = kTransposedA ? A[k * lda + m] : A[m * lda + k];
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(word));
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], a, b[v]);
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < R; ++m) {
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(C + m * ldc + v * 16, acc[m][v]);
  }
}

EMFLOW_CPU_END

#endif  // EMFLOW_CPU_AVX512BF16
