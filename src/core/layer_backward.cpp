// emflow::attend_backward and emflow::attend_factored_backward (include/emflow/backward.hpp): the
// arguments checked once, the route asked of capability.cpp (route(), Operation::backward), and
// the two host paths: the CPU's float kernel (src/cpu/layer_backward.cpp) with the layer given to
// it as the engine's per-head maps, and the double reference (reference::attend_backward,
// reference::attend_factored_backward) for double input, Device::reference and input with a
// non-finite value the kernel would read.
#include "cpu/layer_backward.hpp"

#include <cstdint>
#include <type_traits>
#include <vector>

#include "backends.hpp"
#include "check.hpp"
#include "emflow/backward.hpp"
#include "emflow/reference.hpp"
#include "low_precision.hpp"
#include "memory.hpp"
#include "queries.hpp"

namespace emflow {

namespace detail {

namespace {

/// The shapes of a validated call.
struct Sizes {
  std::int64_t B, N, Nq, d, H;
  template <class T>
  Sizes(const AttentionInput<T>& in, std::int64_t heads)
      : B(in.batch), N(in.tokens), Nq(query_count(in)), d(in.dim), H(heads) {}
  std::size_t cloud() const { return static_cast<std::size_t>(B * N * d); }
  std::size_t queries() const { return static_cast<std::size_t>(B * Nq * d); }
  std::size_t rows() const { return static_cast<std::size_t>(B * H * Nq); }
};

/// The checks shared by both forms, after the input's own: the gradient outputs' presence, then
/// no written array sharing memory with another array of the call.
template <class T>
void check_gradient_outputs(const AttentionInput<T>& in, const UpstreamGradients<T>& up,
                            const T* key_bias, const T* offset, T* queries_gradient,
                            T* key_bias_gradient, T* offset_gradient,
                            std::vector<MemoryRange> ranges, const Sizes& s, const char* op) {
  if (in.queries == nullptr && queries_gradient != nullptr) {
    fail_argument(op, "gradients.queries",
                  "must be null for self-attention (the query part is in gradients.cloud)");
  }
  if (key_bias == nullptr && key_bias_gradient != nullptr) {
    fail_argument(op, "gradients.key_bias", "must be null: the layer has no key_bias");
  }
  if (offset == nullptr && offset_gradient != nullptr) {
    fail_argument(op, "gradients.offset", "must be null: the layer has no offset");
  }
  const auto B = static_cast<std::size_t>(s.B);
  ranges.insert(ranges.end(),
                {{"cloud", in.cloud, s.cloud() * sizeof(T), false},
                 {"queries", in.queries, s.queries() * sizeof(T), false},
                 {"key_lengths", in.key_lengths, B * sizeof(std::int64_t), false},
                 {"query_lengths", in.query_lengths, B * sizeof(std::int64_t), false},
                 {"query_positions", in.query_positions, B * sizeof(std::int64_t), false},
                 {"upstream.update", up.update, s.queries() * sizeof(T), false},
                 {"upstream.lse", up.lse, s.rows() * sizeof(Stat<T>), false},
                 {"upstream.entropy", up.entropy, s.rows() * sizeof(Stat<T>), false}});
  check_disjoint(ranges.data(), ranges.size(), op);
}

void check_options(const ExecutionOptions& options, const char* op) {
  check_threads(options.threads, op);
}

template <class T>
Tensor<double> tensor_of(const T* data, const Shape& shape) {
  if (data == nullptr) return {};
  Tensor<double> t(shape);
  for (std::int64_t e = 0; e < t.size(); ++e) t[e] = static_cast<double>(data[e]);
  return t;
}

template <class T>
void store(const Tensor<double>& values, T* out) {
  if (out == nullptr) return;
  for (std::int64_t e = 0; e < values.size(); ++e) out[e] = static_cast<T>(values[e]);
}

template <class T>
reference::Visibility visibility_of(const AttentionInput<T>& in) {
  reference::Visibility v;
  v.mask = in.mask;
  if (in.key_lengths) v.key_lengths.assign(in.key_lengths, in.key_lengths + in.batch);
  if (in.query_lengths) v.query_lengths.assign(in.query_lengths, in.query_lengths + in.batch);
  v.key_position = in.key_position;
  v.query_position = in.query_position;
  if (in.query_positions) {
    v.query_positions.assign(in.query_positions, in.query_positions + in.batch);
  }
  return v;
}

template <class T>
reference::OutputGradients upstream_of(const UpstreamGradients<T>& up, const Sizes& s) {
  reference::OutputGradients r;
  r.update = tensor_of(up.update, {s.B, s.Nq, s.d});
  r.lse = tensor_of(up.lse, {s.B, s.H, s.Nq});
  r.entropy = tensor_of(up.entropy, {s.B, s.H, s.Nq});
  return r;
}

template <class T>
void reference_dense(const AttentionInput<T>& in, const UpstreamGradients<T>& up,
                     const LayerGradientOutput<T>& out) {
  const Sizes s(in, in.layer.heads);
  const std::int64_t H = s.H, d = s.d;
  reference::Layer layer;
  layer.relevance = tensor_of(in.layer.relevance, {H, d, d});
  layer.content = tensor_of(in.layer.content, {H, d, d});
  layer.key_bias = tensor_of(in.layer.key_bias, {H, d});
  layer.offset = tensor_of(in.layer.offset, {d});
  const reference::LayerGradients g = reference::attend_backward(
      tensor_of(in.cloud, {s.B, s.N, d}), tensor_of(in.queries, {s.B, s.Nq, d}), layer, in.beta,
      visibility_of(in), upstream_of(up, s));
  store(g.cloud, out.cloud);
  store(g.queries, out.queries);
  store(g.relevance, out.relevance);
  store(g.content, out.content);
  store(g.key_bias, out.key_bias);
  store(g.offset, out.offset);
  if (out.beta) *out.beta = g.beta;
}

template <class T>
void reference_factored(const AttentionInput<T>& in, const FactoredLayer<T>& f,
                        const UpstreamGradients<T>& up, const FactoredGradientOutput<T>& out) {
  const Sizes s(in, f.heads);
  const std::int64_t H = s.H, d = s.d, r = f.rank;
  reference::FactoredLayer layer;
  layer.query_factor = tensor_of(f.query_factor, {H, r, d});
  layer.key_factor = tensor_of(f.key_factor, {H, r, d});
  layer.content_up = tensor_of(f.content_up, {H, d, r});
  layer.content_down = tensor_of(f.content_down, {H, r, d});
  layer.key_bias = tensor_of(f.key_bias, {H, d});
  layer.offset = tensor_of(f.offset, {d});
  const reference::FactoredGradients g = reference::attend_factored_backward(
      tensor_of(in.cloud, {s.B, s.N, d}), tensor_of(in.queries, {s.B, s.Nq, d}), layer, in.beta,
      visibility_of(in), upstream_of(up, s));
  store(g.cloud, out.cloud);
  store(g.queries, out.queries);
  store(g.query_factor, out.query_factor);
  store(g.key_factor, out.key_factor);
  store(g.content_up, out.content_up);
  store(g.content_down, out.content_down);
  store(g.key_bias, out.key_bias);
  store(g.offset, out.offset);
  if (out.beta) *out.beta = g.beta;
}

/// The clouds and rules of a float call, for the CPU kernel.
struct Clouds {
  std::vector<QueryRule> rules;
  cpu::BackwardClouds clouds;
  explicit Clouds(const AttentionInput<float>& in) {
    for (std::int64_t b = 0; b < in.batch; ++b) rules.push_back(query_rule(in, b));
    clouds.keys = in.cloud;
    clouds.queries = query_rows(in);
    clouds.batch = in.batch;
    clouds.tokens = in.tokens;
    clouds.query_tokens = query_count(in);
    clouds.self_attention = in.queries == nullptr;
    clouds.rules = rules.data();
  }
};

cpu::LayerUpstream upstream_arrays(const UpstreamGradients<float>& up) {
  return {up.update, up.lse, up.entropy};
}

/// The dense layer on the CPU in float: query_map = M_h, query_bias = u_h, the keys the cloud,
/// value_map = F_h^T (layer_backward.hpp). False when the kernel found a non-finite value.
bool cpu_dense(const AttentionInput<float>& in, const UpstreamGradients<float>& up,
               const LayerGradientOutput<float>& out, int threads) {
  const std::int64_t H = in.layer.heads, d = in.dim;
  const auto hdd = static_cast<std::size_t>(H * d * d);
  std::vector<float> value_map(hdd), value_grad(out.content ? hdd : 0);
  for (std::int64_t h = 0; h < H; ++h) {
    for (std::int64_t k = 0; k < d; ++k) {
      for (std::int64_t a = 0; a < d; ++a) {
        value_map[static_cast<std::size_t>((h * d + k) * d + a)] =
            in.layer.content[(h * d + a) * d + k];
      }
    }
  }
  cpu::BackwardLayer layer;
  layer.heads = H;
  layer.dim = layer.score_dim = layer.value_dim = d;
  layer.query_map = in.layer.relevance;
  layer.query_bias = in.layer.key_bias;
  layer.value_map = value_map.data();
  layer.beta = static_cast<float>(in.beta);
  cpu::BackwardLayerGradients g;
  g.query_map = out.relevance;
  g.query_bias = out.key_bias;
  g.value_map = out.content ? value_grad.data() : nullptr;
  g.keys = out.cloud;
  g.queries = out.queries;
  g.offset = out.offset;
  g.beta = out.beta;
  const Clouds clouds(in);
  if (!cpu::layer_backward(clouds.clouds, layer, upstream_arrays(up), g, threads)) return false;
  if (out.content) {  // dF_h = (dL/d value_map_h)^T
    for (std::int64_t h = 0; h < H; ++h) {
      for (std::int64_t a = 0; a < d; ++a) {
        for (std::int64_t k = 0; k < d; ++k) {
          out.content[(h * d + a) * d + k] =
              value_grad[static_cast<std::size_t>((h * d + k) * d + a)];
        }
      }
    }
  }
  return true;
}

/// The factored layer on the CPU in float: query_map = [A_h^T | 0], query_bias = e_r,
/// key_map = [B_h^T | u_h], value_map = V_h^T, output_map = U_h^T (without a key bias no last
/// column). False when the kernel found a non-finite value.
bool cpu_factored(const AttentionInput<float>& in, const FactoredLayer<float>& f,
                  const UpstreamGradients<float>& up, const FactoredGradientOutput<float>& out,
                  int threads) {
  const std::int64_t H = f.heads, d = in.dim, r = f.rank;
  const bool bias = f.key_bias != nullptr;
  const std::int64_t rs = r + (bias ? 1 : 0);
  auto at = [](std::vector<float>& v, std::int64_t e) -> float& {
    return v[static_cast<std::size_t>(e)];
  };
  std::vector<float> query_map(static_cast<std::size_t>(H * d * rs)), key_map(query_map.size());
  std::vector<float> value_map(static_cast<std::size_t>(H * d * r)), output_map(value_map.size());
  std::vector<float> query_bias(bias ? static_cast<std::size_t>(H * rs) : 0);
  for (std::int64_t h = 0; h < H; ++h) {
    for (std::int64_t k = 0; k < d; ++k) {
      for (std::int64_t c = 0; c < r; ++c) {
        at(query_map, (h * d + k) * rs + c) = f.query_factor[(h * r + c) * d + k];
        at(key_map, (h * d + k) * rs + c) = f.key_factor[(h * r + c) * d + k];
        at(value_map, (h * d + k) * r + c) = f.content_down[(h * r + c) * d + k];
        at(output_map, (h * r + c) * d + k) = f.content_up[(h * d + k) * r + c];
      }
      if (bias) at(key_map, (h * d + k) * rs + r) = f.key_bias[h * d + k];
    }
    if (bias) at(query_bias, h * rs + r) = 1.0f;
  }
  cpu::BackwardLayer layer;
  layer.heads = H;
  layer.dim = d;
  layer.score_dim = rs;
  layer.value_dim = r;
  layer.query_map = query_map.data();
  layer.query_bias = bias ? query_bias.data() : nullptr;
  layer.key_map = key_map.data();
  layer.value_map = value_map.data();
  layer.output_map = output_map.data();
  layer.beta = static_cast<float>(in.beta);
  std::vector<float> query_grad(out.query_factor ? query_map.size() : 0);
  std::vector<float> key_grad(out.key_factor || out.key_bias ? key_map.size() : 0);
  std::vector<float> value_grad(out.content_down ? value_map.size() : 0);
  std::vector<float> output_grad(out.content_up ? output_map.size() : 0);
  auto data = [](std::vector<float>& v) { return v.empty() ? nullptr : v.data(); };
  cpu::BackwardLayerGradients g;
  g.query_map = data(query_grad);
  g.key_map = data(key_grad);
  g.value_map = data(value_grad);
  g.output_map = data(output_grad);
  g.keys = out.cloud;
  g.queries = out.queries;
  g.offset = out.offset;
  g.beta = out.beta;
  const Clouds clouds(in);
  if (!cpu::layer_backward(clouds.clouds, layer, upstream_arrays(up), g, threads)) return false;
  for (std::int64_t h = 0; h < H; ++h) {
    for (std::int64_t k = 0; k < d; ++k) {
      for (std::int64_t c = 0; c < r; ++c) {
        if (out.query_factor)
          out.query_factor[(h * r + c) * d + k] = at(query_grad, (h * d + k) * rs + c);
        if (out.key_factor)
          out.key_factor[(h * r + c) * d + k] = at(key_grad, (h * d + k) * rs + c);
        if (out.content_down)
          out.content_down[(h * r + c) * d + k] = at(value_grad, (h * d + k) * r + c);
        if (out.content_up)
          out.content_up[(h * d + k) * r + c] = at(output_grad, (h * r + c) * d + k);
      }
      if (out.key_bias) out.key_bias[h * d + k] = at(key_grad, (h * d + k) * rs + r);
    }
  }
  return true;
}

}  // namespace

}  // namespace detail

template <class T>
void attend_backward(const AttentionInput<T>& input, const UpstreamGradients<T>& upstream,
                     const LayerGradientOutput<T>& gradients, const ExecutionOptions& options) {
  const char* op = "attend_backward";
  detail::reporting_out_of_memory(op, "", [&] {
    T stand_in{};  // check_arguments wants an update to write: this call writes none
    detail::check_arguments(input, AttentionOutput<T>{&stand_in}, op);
    const detail::Sizes s(input, input.layer.heads);
    const auto H = static_cast<std::size_t>(s.H), d = static_cast<std::size_t>(s.d);
    detail::check_gradient_outputs(
        input, upstream, input.layer.key_bias, input.layer.offset, gradients.queries,
        gradients.key_bias, gradients.offset,
        {{"relevance", input.layer.relevance, H * d * d * sizeof(T), false},
         {"content", input.layer.content, H * d * d * sizeof(T), false},
         {"key_bias", input.layer.key_bias, H * d * sizeof(T), false},
         {"offset", input.layer.offset, d * sizeof(T), false},
         {"gradients.cloud", gradients.cloud, s.cloud() * sizeof(T), true},
         {"gradients.queries", gradients.queries, s.queries() * sizeof(T), true},
         {"gradients.relevance", gradients.relevance, H * d * d * sizeof(T), true},
         {"gradients.content", gradients.content, H * d * d * sizeof(T), true},
         {"gradients.key_bias", gradients.key_bias, H * d * sizeof(T), true},
         {"gradients.offset", gradients.offset, d * sizeof(T), true},
         {"gradients.beta", gradients.beta, sizeof(double), true}},
        s, op);
    detail::check_options(options, op);
    detail::check_precision<T>(options, op);
    Problem problem = describe(input, AttentionOutput<T>{}, options);
    problem.operation = Operation::backward;
    const Route route = require_route(problem, options.device, op);
    if constexpr (std::is_same_v<T, float>) {
      if (route.kernel == Kernel::cpu_fused &&
          detail::cpu_dense(input, upstream, gradients, options.threads)) {
        return;
      }
    }
    detail::reference_dense(input, upstream, gradients);
  });
}

template <class T>
void attend_factored_backward(const AttentionInput<T>& input, const FactoredLayer<T>& layer,
                              const UpstreamGradients<T>& upstream,
                              const FactoredGradientOutput<T>& gradients,
                              const ExecutionOptions& options) {
  const char* op = "attend_factored_backward";
  detail::reporting_out_of_memory(op, "", [&] {
    T stand_in{};
    detail::check_factored(input, layer, AttentionOutput<T>{&stand_in}, op);
    if (layer.rotary.dim != 0 || layer.key_heads() != layer.heads) {
      detail::fail(ErrorCode::unsupported, op,
                   ": rotary positions (rotary.dim) and grouped kv heads (kv_heads) have no "
                   "backward pass yet, got rotary.dim ",
                   layer.rotary.dim, ", kv_heads ", layer.key_heads(), " of ", layer.heads,
                   " heads");
    }
    const detail::Sizes s(input, layer.heads);
    const auto H = static_cast<std::size_t>(s.H), d = static_cast<std::size_t>(s.d);
    const auto r = static_cast<std::size_t>(layer.rank);
    detail::check_gradient_outputs(
        input, upstream, layer.key_bias, layer.offset, gradients.queries, gradients.key_bias,
        gradients.offset,
        {{"query_factor", layer.query_factor, H * r * d * sizeof(T), false},
         {"key_factor", layer.key_factor, H * r * d * sizeof(T), false},
         {"content_up", layer.content_up, H * d * r * sizeof(T), false},
         {"content_down", layer.content_down, H * r * d * sizeof(T), false},
         {"key_bias", layer.key_bias, H * d * sizeof(T), false},
         {"offset", layer.offset, d * sizeof(T), false},
         {"gradients.cloud", gradients.cloud, s.cloud() * sizeof(T), true},
         {"gradients.queries", gradients.queries, s.queries() * sizeof(T), true},
         {"gradients.query_factor", gradients.query_factor, H * r * d * sizeof(T), true},
         {"gradients.key_factor", gradients.key_factor, H * r * d * sizeof(T), true},
         {"gradients.content_up", gradients.content_up, H * d * r * sizeof(T), true},
         {"gradients.content_down", gradients.content_down, H * r * d * sizeof(T), true},
         {"gradients.key_bias", gradients.key_bias, H * d * sizeof(T), true},
         {"gradients.offset", gradients.offset, d * sizeof(T), true},
         {"gradients.beta", gradients.beta, sizeof(double), true}},
        s, op);
    detail::check_options(options, op);
    detail::check_precision<T>(options, op);
    Problem problem = describe(input, layer, AttentionOutput<T>{}, options);
    problem.operation = Operation::backward;
    const Route route = require_route(problem, options.device, op);
    if constexpr (std::is_same_v<T, float>) {
      if (route.kernel == Kernel::cpu_fused &&
          detail::cpu_factored(input, layer, upstream, gradients, options.threads)) {
        return;
      }
    }
    detail::reference_factored(input, layer, upstream, gradients);
  });
}

#define EMFLOW_BACKWARD(T)                                                                  \
  template void attend_backward<T>(const AttentionInput<T>&, const UpstreamGradients<T>&,   \
                                   const LayerGradientOutput<T>&, const ExecutionOptions&); \
  template void attend_factored_backward<T>(                                                \
      const AttentionInput<T>&, const FactoredLayer<T>&, const UpstreamGradients<T>&,       \
      const FactoredGradientOutput<T>&, const ExecutionOptions&);
EMFLOW_BACKWARD(float)
EMFLOW_BACKWARD(double)
#undef EMFLOW_BACKWARD

}  // namespace emflow
