// The backward pass of the SDPA-shaped operator for bfloat16 storage on processors with
// AVX512-BF16: the kernel of the FlashAttention-2 driver (sdpa_backward_driver.hpp, which
// describes the algorithm, the threads and the masks) whose five products run on vdpbf16ps, two
// bfloat16 products per float32 lane and instruction, accumulated in float32.
//
// The operands are the stored values (Q, K, V, dO: bfloat16, so their float copies convert back
// exactly), and per pair of blocks the weights P and the score gradients dS, computed in float32
// and rounded to bfloat16 once before the products that read them, as FlashAttention does in
// 16 bits. Those two roundings are the naive kernel's of the backward's accuracy rule
// (docs/MATH.md §8.8). The scores, the softmax, dP, dS, every sum and the outputs are float32;
// the scale multiplies the float32 scores, dK and dQ (the stored queries are not rescaled, which
// would round them again).
//
// A product C[M x N] += A[M x K] B[K x N] pairs K: one 32-bit word of A holds A(m, 2k) and
// A(m, 2k + 1) and is broadcast, one of B holds B(2k, n) and B(2k + 1, n), 16 columns a vector.
// The operands are packed once per call in the pairings the five products need:
//   per query head   Qa  rows of Q in pairs of coordinates (A of S = Q K^T)
//                    Da  rows of dO in pairs of coordinates (A of dP = dO V^T)
//                    Qb  pairs of rows of Q, by coordinate (B of dK = dS^T Q)
//                    Db  pairs of rows of dO, by coordinate (B of dV = P^T dO)
//   per key head     Kb  per block of 64 keys: pairs of coordinates, by key (B of S)
//                    Vb  the same of V (B of dP)
//                    Kr  pairs of rows of K, by coordinate (B of dQ' = dS K)
// and per pair of blocks: P and dS in pairs of rows by key (A of dV and dK, read transposed) and
// dS in pairs of keys by row (A of dQ'). Zero words pad every pairing, so an odd width, an odd
// row count and a padding row add exact zeros.
#include <immintrin.h>

// GCC 12's AVX-512 reductions start from _mm512_undefined_ps(), which -Wmaybe-uninitialized
// reports inside every caller: a false positive of the intrinsic headers.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "avx512_bf16.hpp"
#include "emflow/precision.hpp"
#include "sdpa.hpp"
#include "sdpa_backward_driver.hpp"
#include "target.hpp"

#if EMFLOW_CPU_AVX512BF16  // the avx512bf16 path only

EMFLOW_CPU_BEGIN

namespace {

using backward::kBlockKeys;
using backward::kBlockQueries;
using backward::RowTerms;
using engine::AlignedBuffer;
using engine::kNegInf;
using engine::round_up;

constexpr int kRows = 4;        // rows of C per micro-kernel call
constexpr int kMaxVectors = 4;  // vectors of 16 columns per micro-kernel call
constexpr std::int64_t kKeyPairs = kBlockKeys / 2;
static_assert(kBlockQueries % (2 * kRows) == 0 && kBlockKeys % 16 == 0, "block sizes");

/// C[rows x columns] (+)= A[rows x K] B[K x columns] for `rows` a multiple of kRows and
/// `columns` of 16, in strips of kMaxVectors vectors; A as for dp_kernel.
template <bool kTransposedA, bool kAccumulate>
__attribute__((noinline)) void dp_gemm(std::int64_t rows, std::int64_t K, const Word* A,
                                       std::int64_t lda, const Word* B, std::int64_t ldb,
                                       std::int64_t columns, float* C, std::int64_t ldc) {
  for (std::int64_t m = 0; m < rows; m += kRows) {
    const Word* a = kTransposedA ? A + m : A + m * lda;
    float* c = C + m * ldc;
    std::int64_t v = 0;
    const std::int64_t vectors = columns / 16;
    for (; v + kMaxVectors <= vectors; v += kMaxVectors) {
      dp_kernel<kRows, kMaxVectors, kTransposedA, kAccumulate>(K, a, lda, B + v * 16, ldb,
                                                               c + v * 16, ldc);
    }
    switch (vectors - v) {
      case 3:
        dp_kernel<kRows, 3, kTransposedA, kAccumulate>(K, a, lda, B + v * 16, ldb, c + v * 16, ldc);
        break;
      case 2:
        dp_kernel<kRows, 2, kTransposedA, kAccumulate>(K, a, lda, B + v * 16, ldb, c + v * 16, ldc);
        break;
      case 1:
        dp_kernel<kRows, 1, kTransposedA, kAccumulate>(K, a, lda, B + v * 16, ldb, c + v * 16, ldc);
        break;
      default:
        break;
    }
  }
}

/// The words of 16 columns of two rows: (low[c], high[c]) rounded to bfloat16, c = 0..15.
inline __m512i interleave_rows(__m512 low, __m512 high) {
  const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(low));
  const __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(high));
  return _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
}

/// A 64 x 64 float tile's first `rows` rows (an even number) as pairs of rows by key: word
/// (i / 2, j) holds (tile[i][j], tile[i + 1][j]) rounded to bfloat16.
void pair_rows(const float* tile, std::int64_t rows, Word* out) {
  constexpr std::int64_t W = kBlockKeys;
  for (std::int64_t i = 0; i < rows; i += 2) {
    for (std::int64_t v = 0; v < W / 16; ++v) {
      _mm512_storeu_si512(out + i / 2 * W + v * 16,
                          interleave_rows(_mm512_loadu_ps(tile + i * W + v * 16),
                                          _mm512_loadu_ps(tile + (i + 1) * W + v * 16)));
    }
  }
}

/// The AVX512-BF16 kernel of the driver.
class Bf16Kernel {
 public:
  std::int64_t dq_stride, dk_stride, dv_stride;  // the columns of r and rv, rounded to 16
  float dk_factor;                               // dK is summed from Q: the scale multiplies it

  Bf16Kernel(const backward::Shapes& sh, float scale)
      : dq_stride(round_up(sh.r, 16)),
        dk_stride(dq_stride),
        dv_stride(round_up(sh.rv, 16)),
        dk_factor(scale),
        sh_(sh),
        rp_((sh.r + 1) / 2),
        vp_(sh.has_dO ? (sh.rv + 1) / 2 : 0),
        dv_columns_(sh.has_dO ? dv_stride : 0) {}

  std::int64_t query_floats() const {
    return sh_.padded_queries * (rp_ + vp_) + sh_.padded_queries / 2 * (dq_stride + dv_columns_);
  }
  std::int64_t key_floats() const {
    return sh_.padded_tokens * (rp_ + vp_) + sh_.padded_tokens / 2 * dq_stride;
  }

  void pack_query(const SdpaArrays& a, const SdpaBackwardArrays& saved, const QueryRule& rule,
                  std::int64_t head_row, std::int64_t row0, std::int64_t row_end,
                  float* packed) const {
    const Operands q = query_operands(packed);
    const float* Q = a.queries + head_row * sh_.r;
    const float* dO = sh_.has_dO ? saved.output_gradient + head_row * sh_.rv : nullptr;
    // The rows a query without keys reads as zero; so are the rows past the block's end.
    const auto real = [&](std::int64_t i) { return i < row_end && !rule.keys(i).empty(); };
    const auto value = [](const float* rows, std::int64_t width, std::int64_t i, std::int64_t c) {
      return c < width ? rows[i * width + c] : 0.0f;
    };
    for (std::int64_t i = row0; i < row_end; ++i) {
      const bool live = real(i);
      for (std::int64_t p = 0; p < rp_; ++p) {
        q.a[i * rp_ + p] =
            live ? pair_of(value(Q, sh_.r, i, 2 * p), value(Q, sh_.r, i, 2 * p + 1)) : 0;
      }
      for (std::int64_t p = 0; p < vp_; ++p) {
        q.da[i * vp_ + p] =
            live ? pair_of(value(dO, sh_.rv, i, 2 * p), value(dO, sh_.rv, i, 2 * p + 1)) : 0;
      }
    }
    for (std::int64_t i = row0; i < row_end; i += 2) {
      const std::int64_t ip = i / 2;
      const bool first = real(i), second = real(i + 1);
      for (std::int64_t c = 0; c < sh_.r; ++c) {
        q.b[ip * dq_stride + c] =
            pair_of(first ? Q[i * sh_.r + c] : 0.0f, second ? Q[(i + 1) * sh_.r + c] : 0.0f);
      }
      for (std::int64_t c = 0; c < (sh_.has_dO ? sh_.rv : 0); ++c) {
        q.db[ip * dv_stride + c] =
            pair_of(first ? dO[i * sh_.rv + c] : 0.0f, second ? dO[(i + 1) * sh_.rv + c] : 0.0f);
      }
    }
  }

  void pack_keys(const SdpaArrays& a, std::int64_t set, std::int64_t length, std::int64_t row0,
                 std::int64_t row_end, float* packed) const {
    const KeyOperands k = key_operands(packed);
    const float* K = a.keys + set * sh_.Nk * sh_.r;
    const float* V = sh_.has_dO ? a.values + set * sh_.Nk * sh_.rv : nullptr;
    const auto real = [&](std::int64_t j) { return j < row_end && j < length; };
    const auto value = [](const float* rows, std::int64_t width, std::int64_t j, std::int64_t c) {
      return c < width ? rows[j * width + c] : 0.0f;
    };
    const std::int64_t block = row0 / kBlockKeys;
    for (std::int64_t j = row0; j < row_end; ++j) {
      const std::int64_t jj = j - row0;
      for (std::int64_t p = 0; p < rp_; ++p) {
        k.b[(block * rp_ + p) * kBlockKeys + jj] =
            real(j) ? pair_of(value(K, sh_.r, j, 2 * p), value(K, sh_.r, j, 2 * p + 1)) : 0;
      }
      for (std::int64_t p = 0; p < vp_; ++p) {
        k.vb[(block * vp_ + p) * kBlockKeys + jj] =
            real(j) ? pair_of(value(V, sh_.rv, j, 2 * p), value(V, sh_.rv, j, 2 * p + 1)) : 0;
      }
    }
    for (std::int64_t j = row0; j < row_end; j += 2) {
      for (std::int64_t c = 0; c < sh_.r; ++c) {
        k.rows[j / 2 * dq_stride + c] =
            pair_of(real(j) ? K[j * sh_.r + c] : 0.0f, real(j + 1) ? K[(j + 1) * sh_.r + c] : 0.0f);
      }
    }
  }

  /// Per-thread working memory.
  struct Tiles {
    explicit Tiles(const Bf16Kernel& /*kernel*/)
        : scores(kBlockQueries * kBlockKeys),
          weights(kBlockQueries * kBlockKeys),
          grads(kBlockQueries * kBlockKeys),
          weight_pairs(kBlockQueries / 2 * kBlockKeys),
          grad_pairs(kBlockQueries / 2 * kBlockKeys),
          grad_rows(kBlockQueries * kKeyPairs) {}
    AlignedBuffer scores;        // scale Q K^T, then S - lse: 64 x 64
    AlignedBuffer weights;       // P: 64 x 64
    AlignedBuffer grads;         // dP, then dS: 64 x 64
    AlignedBuffer weight_pairs;  // P in pairs of rows, by key: 32 x 64 words
    AlignedBuffer grad_pairs;    // dS likewise
    AlignedBuffer grad_rows;     // dS in pairs of keys, by row: 64 x 32 words
  };

  void block_pair(const float* query, const RowTerms& terms, const float* key,
                  const QueryRule& rule, std::int64_t q0, std::int64_t live, std::int64_t k0,
                  bool partial, float* partial_dq, float* dk, float* dv, Tiles& t) const;

 private:
  struct Operands {
    Word *a, *da, *b, *db;
  };
  struct KeyOperands {
    Word *b, *vb, *rows;
  };
  Operands query_operands(const float* packed) const {
    Word* base = words(packed);
    Word* da = base + sh_.padded_queries * rp_;
    Word* b = da + sh_.padded_queries * vp_;
    return {base, da, b, b + sh_.padded_queries / 2 * dq_stride};
  }
  KeyOperands key_operands(const float* packed) const {
    Word* base = words(packed);
    Word* vb = base + sh_.padded_tokens * rp_;
    return {base, vb, vb + sh_.padded_tokens * vp_};
  }
  static Word* words(const float* packed) {
    // The driver's buffers are float storage that this kernel only ever reads as words.
    return reinterpret_cast<Word*>(const_cast<float*>(packed));
  }

  backward::Shapes sh_;
  std::int64_t rp_, vp_;     // pairs of coordinates of Q and K, of V and dO (0 without dO)
  std::int64_t dv_columns_;  // dv_stride with dO, else 0 (nothing of dO is packed)
};

/// One pair of blocks: the live rows [q0, q0 + live) of a query head against the keys
/// [k0, k0 + kBlockKeys) of a key head (the algorithm of sdpa_backward_driver.hpp).
void Bf16Kernel::block_pair(const float* query, const RowTerms& terms, const float* key,
                            const QueryRule& rule, std::int64_t q0, std::int64_t live,
                            std::int64_t k0, bool partial, float* partial_dq, float* dk, float* dv,
                            Tiles& t) const {
  constexpr std::int64_t W = kBlockKeys;
  constexpr std::int64_t kVectors = W / 16;
  const Operands q = query_operands(query);
  const KeyOperands k = key_operands(key);
  const std::int64_t rows = round_up(live, 2 * kRows);  // even: whole pairs of rows
  const std::int64_t block = k0 / kBlockKeys;
  float* S = t.scores.data();
  float* P = t.weights.data();
  float* G = t.grads.data();
  Word* P2 = words(t.weight_pairs.data());
  Word* G2 = words(t.grad_pairs.data());
  Word* Gr = words(t.grad_rows.data());
  const float scale = dk_factor;

  // S = Q K^T, then S <- scale S - lse and P = exp(S), the hidden pairs of a partial pair of
  // blocks first set to -inf; the rows past `live` (padding queries) take no part.
  dp_gemm<false, false>(rows, rp_, q.a + q0 * rp_, rp_, k.b + block * rp_ * W, W, W, S, W);
  for (std::int64_t i = 0; i < rows; ++i) {
    float* s = S + i * W;
    float* p = P + i * W;
    if (i >= live) {
      std::fill(p, p + W, 0.0f);
      continue;
    }
    if (partial) backward::set_hidden(rule, q0 + i, k0, s, kNegInf);
    const __m512 lse = _mm512_set1_ps(terms.lse[q0 + i]);
    const __m512 factor = _mm512_set1_ps(scale);
    for (std::int64_t v = 0; v < kVectors; ++v) {
      const __m512 centred = _mm512_sub_ps(_mm512_mul_ps(factor, _mm512_loadu_ps(s + v * 16)), lse);
      _mm512_storeu_ps(s + v * 16, centred);
      _mm512_storeu_ps(p + v * 16, exp_nonpositive_avx512(centred));
    }
  }
  if (vp_ > 0) {
    // dV += P^T dO (P rounded to bfloat16, in pairs of query rows), then dP = dO V^T.
    pair_rows(P, rows, P2);
    dp_gemm<true, true>(W, rows / 2, P2, W, q.db + q0 / 2 * dv_stride, dv_stride, dv_stride, dv,
                        dv_stride);
    dp_gemm<false, false>(rows, vp_, q.da + q0 * vp_, vp_, k.vb + block * vp_ * W, W, W, G, W);
  }
  // dS = P (dP - E - dH (S - lse)), exactly 0 on hidden pairs and padding rows, then rounded to
  // bfloat16 in the two pairings of dK and dQ'.
  for (std::int64_t i = 0; i < rows; ++i) {
    float* g = G + i * W;
    if (i >= live) {
      std::fill(g, g + W, 0.0f);
    } else {
      const __m512 e = _mm512_set1_ps(terms.e[q0 + i]);
      const __m512 dh = _mm512_set1_ps(terms.dh[q0 + i]);
      const float* s = S + i * W;
      const float* p = P + i * W;
      for (std::int64_t v = 0; v < kVectors; ++v) {
        __m512 inner =
            _mm512_sub_ps(vp_ > 0 ? _mm512_loadu_ps(g + v * 16) : _mm512_setzero_ps(), e);
        if (sh_.has_dH) inner = _mm512_fnmadd_ps(dh, _mm512_loadu_ps(s + v * 16), inner);
        _mm512_storeu_ps(g + v * 16, _mm512_mul_ps(_mm512_loadu_ps(p + v * 16), inner));
      }
      // The hidden pairs: p = 0 there, but the entropy's term reads S - lse = -inf.
      if (partial) backward::set_hidden(rule, q0 + i, k0, g, 0.0f);
    }
    for (std::int64_t v = 0; v < kVectors; ++v) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(Gr + i * kKeyPairs + v * 8),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(g + v * 16)));
    }
  }
  pair_rows(G, rows, G2);
  // dK += dS^T Q (the scale applied when the driver writes dK) and dQ' += dS K.
  dp_gemm<true, true>(W, rows / 2, G2, W, q.b + q0 / 2 * dq_stride, dq_stride, dq_stride, dk,
                      dq_stride);
  dp_gemm<false, true>(rows, kKeyPairs, Gr, kKeyPairs, k.rows + k0 / 2 * dq_stride, dq_stride,
                       dq_stride, partial_dq + q0 * dq_stride, dq_stride);
}

}  // namespace

void sdpa_backward_bf16(const SdpaArrays& a, const SdpaBackwardArrays& saved,
                        const SdpaGradientArrays& out, int threads) {
  backward::run<Bf16Kernel>(a, saved, out, threads);
}

EMFLOW_CPU_END

#endif  // EMFLOW_CPU_AVX512BF16
