// The factored form of a layer (include/emflow/factored.hpp) in the fused CPU engine, in float:
// Kernel::cpu_fused for Form::factored (src/core/factored.cpp routes to it).
//
// The engine (engine.hpp) runs in rank r: queries beta A_h x_i and keys B_h x_j in R^r, values
// V_h x_j in R^r, and the head output mapped back by U_h. The key bias joins the scores as one
// more coordinate: queries [beta A_h x_i, 1], keys [B_h x_j, beta u_h^T x_j], so
// s_ij = beta (<A_h x_i, B_h x_j> + u_h^T x_j) in one product. Input holding a non-finite value
// never reaches it (route() sends it to the expanded reference, or for a rotary layer to the
// double reference of the factored form).
//
// Grouped kv heads: the keys B_g x_j and values V_g x_j are projected once per kv head g and
// shared by the heads h / (H / K) = g (with a key bias the keys once per head, since their last
// column is the head's beta u_h^T x_j). Rotary positions: the engine rotates the first
// rotary.dim coordinates of every projected query and key by its position (engine.hpp); the
// bias coordinate is not rotated, and beta commutes with the rotation.
#include <vector>

#include "core/backends.hpp"
#include "core/queries.hpp"
#include "core/rotary.hpp"
#include "engine.hpp"
#include "target.hpp"

EMFLOW_CPU_BEGIN

void cpu_attend_factored(const AttentionInput<float>& input, const FactoredLayer<float>& f,
                         const AttentionOutput<float>& output, int threads) {
  const std::int64_t H = f.heads, K = f.key_heads(), r = f.rank, d = input.dim;
  const bool bias = f.key_bias != nullptr;
  const std::int64_t score_dim = r + (bias ? 1 : 0);
  const std::int64_t score_stride = padded_columns(score_dim);
  const std::int64_t value_stride = padded_columns(r);
  const std::int64_t dim_stride = padded_columns(d);
  const std::int64_t group = H / K;  // query head h reads kv head h / group
  // Keys: one set per kv head, shared by its group; with a key bias, whose column belongs to the
  // query head, one per head. Values: one set per kv head.
  const std::int64_t key_sets = bias ? H : K;
  const float beta = static_cast<float>(input.beta);
  auto at = [](std::vector<float>& v, std::int64_t i) -> float& {
    return v[static_cast<std::size_t>(i)];
  };

  std::vector<float> query_map(static_cast<std::size_t>(H * d * score_stride), 0.0f);
  std::vector<float> key_map(static_cast<std::size_t>(key_sets * d * score_stride), 0.0f);
  std::vector<float> value_map(static_cast<std::size_t>(K * d * value_stride), 0.0f);
  std::vector<float> output_map(static_cast<std::size_t>(H * r * dim_stride), 0.0f);
  std::vector<float> query_bias;
  if (bias) query_bias.assign(static_cast<std::size_t>(H * score_stride), 0.0f);
  for (std::int64_t h = 0; h < H; ++h) {
    const float* A = f.query_factor + h * r * d;
    const float* U = f.content_up + h * d * r;
    for (std::int64_t k = 0; k < d; ++k) {
      for (std::int64_t c = 0; c < r; ++c) {
        at(query_map, (h * d + k) * score_stride + c) = beta * A[c * d + k];
        at(output_map, (h * r + c) * dim_stride + k) = U[k * r + c];
      }
    }
    if (bias) at(query_bias, h * score_stride + r) = 1.0f;
  }
  for (std::int64_t set = 0; set < key_sets; ++set) {
    const float* B = f.key_factor + (bias ? set / group : set) * r * d;
    for (std::int64_t k = 0; k < d; ++k) {
      for (std::int64_t c = 0; c < r; ++c)
        at(key_map, (set * d + k) * score_stride + c) = B[c * d + k];
      if (bias) at(key_map, (set * d + k) * score_stride + r) = beta * f.key_bias[set * d + k];
    }
  }
  for (std::int64_t g = 0; g < K; ++g) {
    const float* V = f.content_down + g * r * d;
    for (std::int64_t k = 0; k < d; ++k) {
      for (std::int64_t c = 0; c < r; ++c)
        at(value_map, (g * d + k) * value_stride + c) = V[c * d + k];
    }
  }
  const RotaryCall rotary = rotary_call(input, f.rotary);

  EngineLayer layer;
  layer.heads = H;
  layer.dim = d;
  layer.score_dim = score_dim;
  layer.value_dim = r;
  layer.query_map = query_map.data();
  layer.query_bias = bias ? query_bias.data() : nullptr;
  layer.key_map = key_map.data();
  layer.value_map = value_map.data();
  layer.output_map = output_map.data();
  layer.offset = f.offset;
  layer.key_sets = key_sets;
  layer.value_sets = K;
  layer.rotary = rotary.dim != 0 ? &rotary : nullptr;
  std::vector<QueryRule> rules;
  for (std::int64_t b = 0; b < input.batch; ++b) rules.push_back(query_rule(input, b));
  EngineClouds clouds;
  clouds.keys = input.cloud;
  clouds.queries = query_rows(input);
  clouds.batch = input.batch;
  clouds.tokens = input.tokens;
  clouds.query_tokens = query_count(input);
  clouds.rules = rules.data();
  EngineOutput sink;
  sink.attend = output;
  fused_attend(clouds, layer, sink, threads);
}

EMFLOW_CPU_END
