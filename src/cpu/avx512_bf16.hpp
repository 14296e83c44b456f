// What the AVX512-BF16 kernels share (attend_bf16.cpp, sdpa_backward_bf16.cpp): their target and
// the float32 exp of their softmax.
//
// The kernel functions carry __attribute__((target(...))) instead of their files being compiled
// with -mavx512bf16: inline functions and templates of a translation unit compiled for another
// instruction set can be picked by the linker for the whole program, and would then fault on a
// processor without it. Every function here carries the attribute, so whichever copy the linker
// keeps is one of them. Callers check cpu_bf16_available() (core/backends.hpp) first.
#pragma once

#include <immintrin.h>

#include "simd.hpp"

#define EMFLOW_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

namespace emflow::detail::cpu {

/// exp(x) for x <= 0 (and -inf, giving 0): exp_nonpositive of simd.hpp with its constants, in
/// AVX-512 intrinsics for the AVX512-BF16 target.
EMFLOW_BF16_TARGET inline __m512 exp_nonpositive_avx512(__m512 x) {
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

}  // namespace emflow::detail::cpu
