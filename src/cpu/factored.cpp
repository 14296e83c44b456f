// The factored form of a layer (include/emflow/factored.hpp) in the fused CPU engine, in float:
// Kernel::cpu_fused for Form::factored (src/core/factored.cpp routes to it).
//
// The engine (engine.hpp) runs in rank r: queries beta A_h x_i and keys B_h x_j in R^r, values
// V_h x_j in R^r, and the head output mapped back by U_h. The key bias joins the scores as one
// more coordinate: queries [beta A_h x_i, 1], keys [B_h x_j, beta u_h^T x_j], so
// s_ij = beta (<A_h x_i, B_h x_j> + u_h^T x_j) in one product. Input holding a non-finite value
// never reaches it (route() sends it to the expanded reference).
#include <vector>

#include "core/backends.hpp"
#include "core/queries.hpp"
#include "engine.hpp"

namespace emflow::detail {

void cpu_attend_factored(const AttentionInput<float>& input, const FactoredLayer<float>& f,
                         const AttentionOutput<float>& output, int threads) {
  const std::int64_t H = f.heads, r = f.rank, d = input.dim;
  const bool bias = f.key_bias != nullptr;
  const std::int64_t score_dim = r + (bias ? 1 : 0);
  const std::int64_t score_stride = cpu::padded_columns(score_dim);
  const std::int64_t value_stride = cpu::padded_columns(r);
  const std::int64_t dim_stride = cpu::padded_columns(d);
  const float beta = static_cast<float>(input.beta);
  auto at = [](std::vector<float>& v, std::int64_t i) -> float& {
    return v[static_cast<std::size_t>(i)];
  };

  std::vector<float> query_map(static_cast<std::size_t>(H * d * score_stride), 0.0f);
  std::vector<float> key_map(query_map.size(), 0.0f);
  std::vector<float> value_map(static_cast<std::size_t>(H * d * value_stride), 0.0f);
  std::vector<float> output_map(static_cast<std::size_t>(H * r * dim_stride), 0.0f);
  std::vector<float> query_bias;
  if (bias) query_bias.assign(static_cast<std::size_t>(H * score_stride), 0.0f);
  for (std::int64_t h = 0; h < H; ++h) {
    const float* A = f.query_factor + h * r * d;
    const float* B = f.key_factor + h * r * d;
    const float* U = f.content_up + h * d * r;
    const float* V = f.content_down + h * r * d;
    for (std::int64_t k = 0; k < d; ++k) {
      for (std::int64_t c = 0; c < r; ++c) {
        at(query_map, (h * d + k) * score_stride + c) = beta * A[c * d + k];
        at(key_map, (h * d + k) * score_stride + c) = B[c * d + k];
        at(value_map, (h * d + k) * value_stride + c) = V[c * d + k];
        at(output_map, (h * r + c) * dim_stride + k) = U[k * r + c];
      }
      if (bias) at(key_map, (h * d + k) * score_stride + r) = beta * f.key_bias[h * d + k];
    }
    if (bias) at(query_bias, h * score_stride + r) = 1.0f;
  }

  cpu::EngineLayer layer;
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
  std::vector<QueryRule> rules;
  for (std::int64_t b = 0; b < input.batch; ++b) rules.push_back(query_rule(input, b));
  cpu::EngineClouds clouds;
  clouds.keys = input.cloud;
  clouds.queries = query_rows(input);
  clouds.batch = input.batch;
  clouds.tokens = input.tokens;
  clouds.query_tokens = query_count(input);
  clouds.rules = rules.data();
  cpu::EngineOutput sink;
  sink.attend = output;
  cpu::fused_attend(clouds, layer, sink, threads);
}

}  // namespace emflow::detail
