// The SDPA-shaped operator on the fused float32 CPU engine (include/emflow/sdpa.hpp): the
// forward pass over the engine's key panels and online softmax (sdpa.cpp), and the fused
// backward pass in the FlashAttention-2 way (sdpa_backward.cpp).
//
// Both take validated float arrays in the public layout, every value they read finite (callers
// send other input to the reference, as emflow::attend does: a masked pair multiplies its zero
// weight by a value row, and 0 * NaN would reach a query that cannot see the key).
#pragma once

#include <cstdint>

#include "core/queries.hpp"
#include "target.hpp"

namespace emflow::detail::cpu {

/// One call of the SDPA-shaped operator in float: Q (batch, query_heads, query_tokens, rank),
/// K (batch, kv_heads, tokens, rank), V (batch, kv_heads, tokens, value_rank), and the rule of
/// each cloud (`batch` entries).
struct SdpaArrays {
  const float* queries = nullptr;
  const float* keys = nullptr;
  const float* values = nullptr;
  std::int64_t batch = 1, query_heads = 1, kv_heads = 1, query_tokens = 0, tokens = 0, rank = 0,
               value_rank = 0;
  /// The scale as the float products see it (rounded to float once, as beta is).
  float scale = 1.0f;
  const QueryRule* rules = nullptr;

  std::int64_t group() const { return query_heads / kv_heads; }
};

/// What the backward pass reads besides the operator's inputs: the forward's O, lse and H, and
/// the upstream gradients dO, dlse and dH (each null when the loss does not depend on it; O is
/// read only with dO, H only with dH). Rows of queries that see no key are never read.
struct SdpaBackwardArrays {
  const float* output = nullptr;
  const float* lse = nullptr;
  const float* entropy = nullptr;
  const float* output_gradient = nullptr;
  const float* lse_gradient = nullptr;
  const float* entropy_gradient = nullptr;
};

/// Where the backward pass writes: dQ, dK and dV in the layouts of Q, K and V (every element
/// written), and dL/dscale when not null.
struct SdpaGradientArrays {
  float* queries = nullptr;
  float* keys = nullptr;
  float* values = nullptr;
  double* scale = nullptr;
};

}  // namespace emflow::detail::cpu

// The functions of a path (target.hpp): in a path's compilation its own, elsewhere the calls
// through the path this process takes (dispatch.cpp).
EMFLOW_CPU_BEGIN

/// True when every value of `arrays` that a query reads is finite: the query rows i < Lq_b and
/// the key and value rows j < Lk_b of each cloud (the rows the rule can make visible).
bool sdpa_inputs_finite(const SdpaArrays& arrays);

/// The forward pass: O (batch, query_heads, query_tokens, value_rank) and, when not null, lse and
/// entropy (batch, query_heads, query_tokens), on `threads` OpenMP threads (0: the OpenMP
/// default, or one thread for a call of under 4 MFLOP). Bitwise the same for any thread count.
void sdpa_forward(const SdpaArrays& arrays, float* output, float* lse, float* entropy, int threads);

/// True when every value of `saved` that the backward pass reads is finite: the rows of the
/// queries that see a key.
bool sdpa_backward_finite(const SdpaArrays& arrays, const SdpaBackwardArrays& saved);

/// The backward pass (docs/MATH.md §8.3; the algorithm at the top of sdpa_backward.cpp), on
/// `threads` OpenMP threads as sdpa_forward. Bitwise the same for any thread count: the keys
/// are split into spans that depend on the shape only, each span's dQ is accumulated in a
/// float32 buffer of its own, and the spans are summed in order.
void sdpa_backward(const SdpaArrays& arrays, const SdpaBackwardArrays& saved,
                   const SdpaGradientArrays& gradients, int threads);

/// The backward pass with bfloat16 products (sdpa_backward_bf16.cpp): the arguments and the
/// guarantees of sdpa_backward, for Q, K, V and dO holding bfloat16 values (widened to float,
/// exactly), whose products run on AVX512-BF16 with float32 accumulation, P and dS rounded to
/// bfloat16 before the products that read them (docs/MATH.md §8.8). On the avx512bf16 path only
/// (Machine::avx512_bf16).
void sdpa_backward_bf16(const SdpaArrays& arrays, const SdpaBackwardArrays& saved,
                        const SdpaGradientArrays& gradients, int threads);

#if defined(EMFLOW_CPU_TARGET)  // within the paths only

// Packing, shared by the two passes: each helper writes the rows [row0, row_end) of one head.

/// Query rows times `scale`, `width` columns into rows of `stride` floats; zero on the rows that
/// see no key under `rule` (padding, or positioned before every key), which are never read.
void pack_query_rows(const float* rows, std::int64_t width, float scale, const QueryRule& rule,
                     std::int64_t row0, std::int64_t row_end, float* out, std::int64_t stride);
/// Key or value rows j < `length` (the real keys) copied into rows of `stride` floats, zero for
/// the others, so that a hidden pair's zero weight meets a zero row.
void pack_real_rows(const float* rows, std::int64_t width, std::int64_t length, std::int64_t row0,
                    std::int64_t row_end, float* out, std::int64_t stride);
/// The same rows into the engine's transposed panels of width x key_tile() floats (engine.hpp).
void pack_real_panels(const float* rows, std::int64_t width, std::int64_t length, std::int64_t row0,
                      std::int64_t row_end, float* panels);

#endif

EMFLOW_CPU_END
