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
#include "target.hpp"

EMFLOW_CPU_BEGIN

namespace {

/// The clouds and rules of a call, for the engine.
struct Clouds {
  std::vector<QueryRule> rules;
  EngineClouds clouds;

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
  const DenseMaps maps(in);
  const Clouds clouds(in);
  EngineOutput sink;
  sink.attend = out;
  fused_attend(clouds.clouds, maps.layer, sink, threads);
}

void cpu_partial(const AttentionInput<float>& in, const PartialOutput<float>& out, int threads) {
  const DenseMaps maps(in);
  const Clouds clouds(in);
  EngineOutput sink;
  sink.partial = out;
  fused_attend(clouds.clouds, maps.layer, sink, threads);
}

EMFLOW_CPU_END
