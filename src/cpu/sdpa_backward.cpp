// The backward pass of the SDPA-shaped operator on the CPU (sdpa.hpp, docs/MATH.md §8.3) with
// float32 products: the kernel of the FlashAttention-2 driver (sdpa_backward_driver.hpp, which
// describes the algorithm, the threads and the masks), on the engine's vector layer (simd.hpp).
//
// Operands, packed once per call: per query head Q~ = scale Q and dO as rows; per key head K as
// rows and as the engine's transposed panels of kKeyTile keys, V as panels. Per pair of blocks,
// five products of 2 x 64 x 64 x r FLOP, all by the micro-kernel, 4 rows at a time (8 on
// AVX-512): S and dP against the key and value panels, P^T dO and dS^T Q~ reading the tile's
// columns as the micro-kernel's rows (kTransposedA), dS K against the key rows.
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/dispatch.hpp"
#include "engine_internal.hpp"
#include "sdpa.hpp"
#include "sdpa_backward_driver.hpp"
#include "target.hpp"

EMFLOW_CPU_BEGIN

using namespace engine;

namespace {

using backward::kBlockKeys;
using backward::kBlockQueries;
using backward::RowTerms;
static_assert(kBlockKeys % kKeyTile == 0, "whole panels per key block");
static_assert(kBlockQueries % kChunkRows == 0 && kBlockKeys % kChunkRows == 0, "chunk rows");

/// The float32 kernel of the driver.
class Float32Kernel {
 public:
  std::int64_t dq_stride, dk_stride, dv_stride;  // rs, rs, vs: padded row lengths
  float dk_factor = 1.0f;                        // dK is summed from Q~, scale included

  Float32Kernel(const backward::Shapes& sh, float scale)
      : dq_stride(padded_columns(sh.r)),
        dk_stride(dq_stride),
        dv_stride(padded_columns(sh.rv)),
        sh_(sh),
        scale_(scale) {}

  // Per query head: Q~ (padded_queries x rs), then dO (padded_queries x vs) when given.
  std::int64_t query_floats() const { return sh_.padded_queries * (dq_stride + upstream_stride()); }
  // Per key head: K rows (padded_tokens x rs), K panels (r x kKeyTile each), V panels.
  std::int64_t key_floats() const {
    return sh_.padded_tokens * (dq_stride + sh_.r + (sh_.has_dO ? sh_.rv : 0));
  }

  void pack_query(const SdpaArrays& a, const SdpaBackwardArrays& saved, const QueryRule& rule,
                  std::int64_t head_row, std::int64_t row0, std::int64_t row_end,
                  float* packed) const {
    pack_query_rows(a.queries + head_row * sh_.r, sh_.r, scale_, rule, row0, row_end, packed,
                    dq_stride);
    if (sh_.has_dO) {
      pack_query_rows(saved.output_gradient + head_row * sh_.rv, sh_.rv, 1.0f, rule, row0, row_end,
                      upstream(packed), dv_stride);
    }
  }

  void pack_keys(const SdpaArrays& a, std::int64_t set, std::int64_t length, std::int64_t row0,
                 std::int64_t row_end, float* packed) const {
    const float* k = a.keys + set * sh_.Nk * sh_.r;
    pack_real_rows(k, sh_.r, length, row0, row_end, packed, dq_stride);
    pack_real_panels(k, sh_.r, length, row0, row_end, key_panels(packed));
    if (sh_.has_dO) {
      pack_real_panels(a.values + set * sh_.Nk * sh_.rv, sh_.rv, length, row0, row_end,
                       value_panels(packed));
    }
  }

  /// Per-thread working memory.
  struct Tiles {
    explicit Tiles(const Float32Kernel& /*kernel*/)
        : centred(kBlockQueries * kBlockKeys),
          weights(kBlockQueries * kBlockKeys),
          grads(kBlockQueries * kBlockKeys) {}
    AlignedBuffer centred;  // S, then S - lse: kBlockQueries x kBlockKeys
    AlignedBuffer weights;  // P
    AlignedBuffer grads;    // dP, then dS
  };

  void block_pair(const float* query, const RowTerms& terms, const float* key,
                  const QueryRule& rule, std::int64_t q0, std::int64_t live, std::int64_t k0,
                  bool partial, float* partial_dq, float* dk, float* dv, Tiles& t) const;

 private:
  std::int64_t upstream_stride() const { return sh_.has_dO ? dv_stride : 0; }
  float* upstream(float* packed) const { return packed + sh_.padded_queries * dq_stride; }
  const float* upstream(const float* packed) const {
    return packed + sh_.padded_queries * dq_stride;
  }
  float* key_panels(float* packed) const { return packed + sh_.padded_tokens * dq_stride; }
  const float* key_panels(const float* packed) const {
    return packed + sh_.padded_tokens * dq_stride;
  }
  float* value_panels(float* packed) const {
    return key_panels(packed) + sh_.padded_tokens * sh_.r;
  }
  const float* value_panels(const float* packed) const {
    return key_panels(packed) + sh_.padded_tokens * sh_.r;
  }

  backward::Shapes sh_;
  float scale_;
};

/// One pair of blocks: the live rows [q0, q0 + live) of a query head against the keys
/// [k0, k0 + kBlockKeys) of a key head (the algorithm of sdpa_backward_driver.hpp).
void Float32Kernel::block_pair(const float* query, const RowTerms& terms, const float* key,
                               const QueryRule& rule, std::int64_t q0, std::int64_t live,
                               std::int64_t k0, bool partial, float* partial_dq, float* dk,
                               float* dv, Tiles& t) const {
  constexpr std::int64_t W = kBlockKeys;
  constexpr std::int64_t kVectors = W / kLanes;
  const std::int64_t rs = dq_stride, vs = dv_stride;
  const std::int64_t rows = round_up(live, kChunkRows);
  const std::int64_t tile0 = k0 / kKeyTile;
  float* S = t.centred.data();
  float* P = t.weights.data();
  float* G = t.grads.data();
  const float* Q = query + q0 * rs;
  const float* dO = sh_.has_dO ? upstream(query) + q0 * vs : nullptr;
  const float* panels = key_panels(key);

  // S = Q~ K^T, one panel of kKeyTile keys at a time.
  for (std::int64_t i = 0; i < rows; i += kChunkRows) {
    for (std::int64_t p = 0; p < W / kKeyTile; ++p) {
      row_block_gemm<kChunkRows>(sh_.r, Q + i * rs, rs, panels + (tile0 + p) * sh_.r * kKeyTile,
                                 kKeyTile, kKeyTile, S + i * W + p * kKeyTile, W, false);
    }
  }
  // P = exp(S - lse), the hidden pairs of a partial pair of blocks first set to -inf; the rows
  // past `live` (padding queries) take no part.
  for (std::int64_t i = 0; i < rows; ++i) {
    float* s = S + i * W;
    float* p = P + i * W;
    if (i >= live) {
      std::fill(p, p + W, 0.0f);
      continue;
    }
    if (partial) backward::set_hidden(rule, q0 + i, k0, s, kNegInf);
    const Vec lse = splat(terms.lse[q0 + i]);
    for (std::int64_t v = 0; v < kVectors; ++v) {
      const Vec centred = load(s + v * kLanes) - lse;
      store(s + v * kLanes, centred);
      store(p + v * kLanes, exp_nonpositive(centred));
    }
  }
  if (dO != nullptr) {
    // dV += P^T dO (the reduction over the block's query rows), then dP = dO V^T.
    for (std::int64_t j = 0; j < W; j += kChunkRows) {
      row_block_gemm<kChunkRows, true>(rows, P + j, W, dO, vs, vs, dv + j * vs, vs, true);
    }
    const float* values = value_panels(key);
    for (std::int64_t i = 0; i < rows; i += kChunkRows) {
      for (std::int64_t p = 0; p < W / kKeyTile; ++p) {
        row_block_gemm<kChunkRows>(sh_.rv, dO + i * vs, vs,
                                   values + (tile0 + p) * sh_.rv * kKeyTile, kKeyTile, kKeyTile,
                                   G + i * W + p * kKeyTile, W, false);
      }
    }
  }
  // dS = P (dP - E - dH (S - lse)), exactly 0 on hidden pairs and padding rows.
  for (std::int64_t i = 0; i < rows; ++i) {
    float* g = G + i * W;
    if (i >= live) {
      std::fill(g, g + W, 0.0f);
      continue;
    }
    const Vec e = splat(terms.e[q0 + i]);
    const Vec dh = splat(terms.dh[q0 + i]);
    const float* s = S + i * W;
    const float* p = P + i * W;
    for (std::int64_t v = 0; v < kVectors; ++v) {
      Vec inner = (dO != nullptr ? load(g + v * kLanes) : Vec{}) - e;
      if (sh_.has_dH) inner = fma(dh, Vec{} - load(s + v * kLanes), inner);
      store(g + v * kLanes, load(p + v * kLanes) * inner);
    }
    // The hidden pairs: p = 0 there, but the entropy's term reads S - lse = -inf.
    if (partial) backward::set_hidden(rule, q0 + i, k0, g, 0.0f);
  }
  // dK += dS^T Q~ and dQ' += dS K.
  for (std::int64_t j = 0; j < W; j += kChunkRows) {
    row_block_gemm<kChunkRows, true>(rows, G + j, W, Q, rs, rs, dk + j * rs, rs, true);
  }
  for (std::int64_t i = 0; i < rows; i += kChunkRows) {
    row_block_gemm<kChunkRows>(W, G + i * W, W, key + k0 * rs, rs, rs, partial_dq + (q0 + i) * rs,
                               rs, true);
  }
}

}  // namespace

bool sdpa_backward_finite(const SdpaArrays& a, const SdpaBackwardArrays& saved) {
  const std::int64_t Nq = a.query_tokens, rv = a.value_rank;
  for (std::int64_t b = 0; b < a.batch; ++b) {
    const QueryRule& rule = a.rules[b];
    for (std::int64_t h = 0; h < a.query_heads; ++h) {
      const std::int64_t head = (b * a.query_heads + h) * Nq;
      for (std::int64_t i = 0; i < rule.query_length; ++i) {
        if (rule.keys(i).empty()) continue;
        const std::int64_t row = head + i;
        const bool finite =
            all_finite(saved.lse + row, 1) &&
            (!saved.output_gradient || (all_finite(saved.output_gradient + row * rv, rv) &&
                                        all_finite(saved.output + row * rv, rv))) &&
            (!saved.lse_gradient || all_finite(saved.lse_gradient + row, 1)) &&
            (!saved.entropy_gradient ||
             (all_finite(saved.entropy_gradient + row, 1) && all_finite(saved.entropy + row, 1)));
        if (!finite) return false;
      }
    }
  }
  return true;
}

void sdpa_backward(const SdpaArrays& a, const SdpaBackwardArrays& saved,
                   const SdpaGradientArrays& out, int threads) {
  backward::run<Float32Kernel>(a, saved, out, threads);
}

EMFLOW_CPU_END
