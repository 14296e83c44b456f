// Fast CPU backend of emflow::attend for the dense form of a layer (M_h, F_h, u_h, c), in float.
//
// The fused engine (engine.hpp) with the relevance folded into the queries,
//   s_ij = <beta (r_i + u_h), x_j>,  r_i = M_h^T x_i,
// so the keys are the cloud itself, shared by all heads, and the content C_h = X F_h^T is the
// engine's values. Nothing N x N is stored unless the weights are requested.
// Input holding a NaN or infinity never reaches the engine: route() (src/core/capability.cpp)
// sends it to the reference, since the engine's tiles multiply a value row by the weight 0 of the
// queries that the mask hides it from, and 0 * NaN would reach them. Double input is computed by
// the reference too (Kernel::reference): it is for checking, not for speed.
#include <vector>

#include "core/backends.hpp"
#include "core/queries.hpp"
#include "engine.hpp"

namespace emflow::detail {

namespace cpu {

DenseMaps::DenseMaps(const AttentionInput<float>& in) {
  const std::int64_t H = in.layer.heads, d = in.dim;
  const std::int64_t stride = cpu::padded_columns(d);
  const float beta = static_cast<float>(in.beta);
  query_map.assign(static_cast<std::size_t>(H * d * stride), 0.0f);
  value_map.assign(query_map.size(), 0.0f);
  if (in.layer.key_bias != nullptr) query_bias.assign(static_cast<std::size_t>(H * stride), 0.0f);
  for (std::int64_t h = 0; h < H; ++h) {
    const float* M = in.layer.relevance + h * d * d;
    const float* F = in.layer.content + h * d * d;
    for (std::int64_t k = 0; k < d; ++k) {
      for (std::int64_t a = 0; a < d; ++a) {
        query_map[static_cast<std::size_t>((h * d + k) * stride + a)] = beta * M[k * d + a];
        value_map[static_cast<std::size_t>((h * d + k) * stride + a)] = F[a * d + k];
      }
    }
    if (!query_bias.empty()) {
      for (std::int64_t a = 0; a < d; ++a) {
        query_bias[static_cast<std::size_t>(h * stride + a)] = beta * in.layer.key_bias[h * d + a];
      }
    }
  }
  layer.heads = H;
  layer.dim = layer.score_dim = layer.value_dim = d;
  layer.query_map = query_map.data();
  layer.query_bias = query_bias.empty() ? nullptr : query_bias.data();
  layer.value_map = value_map.data();
  layer.offset = in.layer.offset;
}

}  // namespace cpu

namespace {

/// The clouds and rules of a call, for the engine.
struct Clouds {
  std::vector<QueryRule> rules;
  cpu::EngineClouds clouds;

  explicit Clouds(const AttentionInput<float>& in) {
    for (std::int64_t b = 0; b < in.batch; ++b) rules.push_back(query_rule(in, b));
    clouds.keys = in.cloud;
    clouds.queries = query_rows(in);
    clouds.batch = in.batch;
    clouds.tokens = in.tokens;
    clouds.query_tokens = query_count(in);
    clouds.rules = rules.data();
    // Self-attention keeps its one-pass schedule; queries of their own may split the keys.
    clouds.split_keys = in.queries != nullptr;
  }
};

}  // namespace

void cpu_attend(const AttentionInput<float>& in, const AttentionOutput<float>& out, int threads) {
  const cpu::DenseMaps maps(in);
  const Clouds clouds(in);
  cpu::EngineOutput sink;
  sink.attend = out;
  cpu::fused_attend(clouds.clouds, maps.layer, sink, threads);
}

void cpu_partial(const AttentionInput<float>& in, const PartialOutput<float>& out, int threads) {
  const cpu::DenseMaps maps(in);
  const Clouds clouds(in);
  cpu::EngineOutput sink;
  sink.partial = out;
  cpu::fused_attend(clouds.clouds, maps.layer, sink, threads);
}

}  // namespace emflow::detail
