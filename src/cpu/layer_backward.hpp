// The backward pass of a layer on the CPU in float (include/emflow/backward.hpp): the SDPA-shaped
// backward of every head (sdpa.hpp) between the projections, and the chain rule through them as
// batched products of the micro-kernel (layer_backward.cpp).
//
// A layer reaches it as per-head linear maps of the cloud, the engine's terms (engine.hpp), each
// dense row-major (unpadded):
//   queries  q_h,i = x^_i^T query_map_h + query_bias_h       (score_dim columns)
//   keys     k_h,j = x_j^T key_map_h, or x_j when key_map is null (score_dim == dim)
//   values   v_h,j = x_j^T value_map_h                        (value_dim columns)
//   update   delta_i = sum_h o_h,i^T output_map_h, or sum_h o_h,i when output_map is null
// Dense EMF:  query_map = M_h, query_bias = u_h, keys = X, value_map = F_h^T.
// Factored:   query_map = [A_h^T | 0], query_bias = e_r, key_map = [B_h^T | u_h],
//             value_map = V_h^T, output_map = U_h^T  (without a key bias: no last column).
#pragma once

#include <cstdint>

#include "core/queries.hpp"
#include "target.hpp"

namespace emflow::detail::cpu {

struct BackwardLayer {
  std::int64_t heads = 1;
  std::int64_t dim = 1;
  std::int64_t score_dim = 1;
  std::int64_t value_dim = 1;
  const float* query_map = nullptr;   ///< (heads, dim, score_dim)
  const float* query_bias = nullptr;  ///< (heads, score_dim), or null
  const float* key_map = nullptr;     ///< (heads, dim, score_dim), or null
  const float* value_map = nullptr;   ///< (heads, dim, value_dim)
  const float* output_map = nullptr;  ///< (heads, value_dim, dim), or null
  float beta = 1.0f;                  ///< the scores' scale
};

/// The clouds of one call and the rule of each (`batch` entries). For self-attention `queries`
/// is `keys` and query_tokens is tokens.
struct BackwardClouds {
  const float* keys = nullptr;     ///< X: (batch, tokens, dim)
  const float* queries = nullptr;  ///< the query rows: (batch, query_tokens, dim)
  std::int64_t batch = 1, tokens = 0, query_tokens = 0;
  bool self_attention = true;
  const QueryRule* rules = nullptr;
};

/// The upstream gradients: dDelta (batch, query_tokens, dim), dlse and dH (batch, heads,
/// query_tokens), each null when absent.
struct LayerUpstream {
  const float* update = nullptr;
  const float* lse = nullptr;
  const float* entropy = nullptr;
};

/// Where the gradients go, each in the layout of what it differentiates; every pointer optional.
struct BackwardLayerGradients {
  float* query_map = nullptr;
  float* query_bias = nullptr;
  float* key_map = nullptr;  ///< with a key_map only
  float* value_map = nullptr;
  float* output_map = nullptr;  ///< with an output_map only
  float* keys = nullptr;     ///< dX: the key and value parts, and the query part for self-attention
  float* queries = nullptr;  ///< the query part, for cross-attention
  float* offset = nullptr;   ///< dc: dDelta summed over the queries that see a key
  double* beta = nullptr;
};

}  // namespace emflow::detail::cpu

// The functions of a path (target.hpp): in a path's compilation its own, elsewhere the calls
// through the path this process takes (dispatch.cpp).
EMFLOW_CPU_BEGIN

/// The backward pass of the layer (docs/MATH.md §8.4, §8.5) on `threads` OpenMP threads (0: the
/// OpenMP default, or one for a small call), bitwise the same for any thread count. Returns
/// false, having written nothing, when a value it would read is not finite (the caller then runs
/// the reference, which puts NaN where docs/MATH.md §8.6 says).
bool layer_backward(const BackwardClouds& clouds, const BackwardLayer& layer,
                    const LayerUpstream& upstream, const BackwardLayerGradients& gradients,
                    int threads);

EMFLOW_CPU_END
