// Running a converted model's layers on token clouds: attention through emflow::attend with the
// layer's EMF operators, then the residual, the layer norms (with the model's eps) and the
// feed-forward block in the order of the model's layout (emflow/model.hpp).
#include <algorithm>
#include <cmath>
#include <type_traits>

#include "core/check.hpp"
#include "emflow/factored.hpp"
#include "emflow/model.hpp"
#include "llama_layers.hpp"

namespace emflow::model {
namespace {

using detail::fail_argument;
using layers::activate;
using layers::BiasedFactors;
using layers::cast;
using layers::Factors;
using layers::gated_feed_forward;
using layers::rms_norm;

// out_r = W_out act(W_in x_r + b_in) + b_out for every row, accumulated in double.
template <class T>
void feed_forward(const ModelLayer& layer, Activation activation, const T* in, T* out,
                  std::int64_t rows, std::int64_t d) {
  const std::int64_t I = layer.ffn_in.extent(0);
  const double* w_in = layer.ffn_in.data();
  const double* w_out = layer.ffn_out.data();
#pragma omp parallel for schedule(static) if (rows * d * I > (1 << 20))
  for (std::int64_t r = 0; r < rows; ++r) {
    std::vector<double> x(in + r * d, in + (r + 1) * d), hidden(static_cast<std::size_t>(I));
    for (std::int64_t k = 0; k < I; ++k) {
      double s = layer.ffn_in_bias[k];
      const double* row = w_in + k * d;
      for (std::int64_t a = 0; a < d; ++a) s += row[a] * x[static_cast<std::size_t>(a)];
      hidden[static_cast<std::size_t>(k)] = activate(activation, s);
    }
    for (std::int64_t a = 0; a < d; ++a) {
      double s = layer.ffn_out_bias[a];
      const double* row = w_out + a * I;
      for (std::int64_t k = 0; k < I; ++k) s += row[k] * hidden[static_cast<std::size_t>(k)];
      out[r * d + a] = static_cast<T>(s);
    }
  }
}

template <class T>
void layer_norm(std::vector<T>& x, std::int64_t rows, std::int64_t d, const Tensor<double>& gain,
                const Tensor<double>& bias, double eps) {
  const std::vector<T> g = cast<T>(gain), b = cast<T>(bias);
  flow::normalize(flow::Normalization::layernorm, x.data(), rows, d, g.data(), b.data(), eps);
}

}  // namespace

template <class T>
ModelTrace<T> run_model(const Model& model, const Tensor<T>& clouds,
                        const std::vector<std::int64_t>& key_lengths, const RunSettings& settings,
                        const ExecutionOptions& options) {
  const char* op = "run_model";
  if (model.layers.empty()) fail_argument(op, "model", "has no layers");
  if (clouds.rank() != 3 || clouds.extent(2) != model.dim || clouds.extent(1) < 1) {
    fail_argument(op, "clouds", "has shape ", emflow::to_string(clouds.shape()),
                  ", expected (B, N, ", model.dim, ") with N >= 1 (d of the model)");
  }
  const std::int64_t B = clouds.extent(0), N = clouds.extent(1), d = model.dim;
  const std::int64_t L = model.layer_count(), H = model.heads, rows = B * N;
  if (!key_lengths.empty()) {
    if (static_cast<std::int64_t>(key_lengths.size()) != B) {
      fail_argument(op, "key_lengths", "has ", key_lengths.size(), " entries, expected ", B,
                    " (one per cloud)");
    }
    for (std::int64_t len : key_lengths) {
      if (len < 1 || len > N) fail_argument(op, "key_lengths", "holds ", len, ", expected 1..", N);
    }
  }
  const bool llama = model.layout == Layout::llama;
  if (!settings.positions.empty()) {
    if (!llama) {
      fail_argument(op, "settings.positions", "are rotary positions, but the ",
                    to_string(model.layout), " layout has no rotary embedding");
    }
    if (static_cast<std::int64_t>(settings.positions.size()) != B * N) {
      fail_argument(op, "settings.positions", "has ", settings.positions.size(),
                    " entries, expected B * N = ", B * N, " (one per token)");
    }
  }
  if (llama && !settings.factored) {
    fail_argument(
        op, "settings.factored",
        "is false, but the llama layout's rotary attention has no single dense M_h "
        "(its relevance depends on the offset of the positions, docs/MATH.md 2.4): run "
        "it in the factored form (settings.factored = true, emflow flow --form factored)");
  }
  // The rotary embedding of every layer: at positions 0..N-1 (the masks'), or those given, for
  // the keys and the queries alike (self-attention).
  Rotary rotary = model.rotary_embedding();
  if (!settings.positions.empty()) {
    rotary.key_positions = rotary.query_positions = settings.positions.data();
  }
  ModelTrace<T> trace;
  trace.trajectory = Tensor<T>(Shape{L + 1, B, N, d});
  trace.attention = Tensor<T>(Shape{L, B, N, d});
  trace.observables.resize(static_cast<std::size_t>((L + 1) * B));
  const std::int64_t cloud_size = N * d;
  auto length_of = [&](std::int64_t b) {
    return key_lengths.empty() ? N : key_lengths[static_cast<std::size_t>(b)];
  };

  std::vector<T> x(clouds.values().begin(), clouds.values().end());
  std::vector<T> normed(x.size()), update(x.size()), ffn(x.size());
  std::vector<T> entropy(static_cast<std::size_t>(B * H * N));
  auto record = [&](std::int64_t r) {
    std::copy(x.begin(), x.end(), trace.trajectory.data() + r * rows * d);
    for (std::int64_t b = 0; b < B; ++b) {
      const std::int64_t n = length_of(b);
      flow::Observables& o = trace.observables[static_cast<std::size_t>(r * B + b)];
      if (n >= 2) o = flow::observe(x.data() + b * cloud_size, n, d, 1.0, settings.cluster_eps);
    }
  };
  record(0);
  const bool pre = model.pre_norm;
  for (std::int64_t l = 0; l < L; ++l) {
    const ModelLayer& layer = model.layers[static_cast<std::size_t>(l)];
    const std::vector<T> M = cast<T>(layer.operators.relevance),
                         F = cast<T>(layer.operators.content);
    const std::vector<T> u = cast<T>(layer.operators.key_bias), c = cast<T>(layer.operators.offset);
    if (llama) {
      normed = x;
      rms_norm(normed.data(), rows, d, layer.norm1_gain, model.norm_eps);
    } else if (pre) {
      normed = x;
      layer_norm(normed, rows, d, layer.norm1_gain, layer.norm1_bias, model.norm_eps);
    }
    AttentionInput<T> in;
    in.cloud = pre ? normed.data() : x.data();
    in.batch = B;
    in.tokens = N;
    in.dim = d;
    in.layer = {H, M.data(), F.data(), u.data(), c.data()};
    in.mask = model.sliding_window > 0 ? Mask::sliding_window(model.sliding_window)
              : model.causal           ? Mask::causal()
                                       : Mask::none();
    in.key_lengths = key_lengths.empty() ? nullptr : key_lengths.data();
    AttentionOutput<T> out;
    out.update = update.data();
    out.entropy = entropy.data();
    const bool biased = llama && layer.attention.query_bias.size() > 0;
    if (biased) {
      // The cloud in d + 1 with a last coordinate 1 (BiasedFactors); the update back in d.
      const BiasedFactors<T> f(layer.attention, model.key_heads());
      std::vector<T> lifted(static_cast<std::size_t>(rows * (d + 1)));
      std::vector<T> lifted_update(lifted.size());
      for (std::int64_t r = 0; r < rows; ++r) {
        std::copy(normed.begin() + r * d, normed.begin() + (r + 1) * d,
                  lifted.begin() + r * (d + 1));
        lifted[static_cast<std::size_t>(r * (d + 1) + d)] = T(1);
      }
      FactoredLayer<T> factored;
      factored.heads = H;
      factored.rank = model.head_dim;
      factored.query_factor = f.a.data();
      factored.key_factor = f.b.data();
      factored.content_up = f.up.data();
      factored.content_down = f.down.data();
      factored.kv_heads = model.key_heads();
      factored.rotary = rotary;
      in.cloud = lifted.data();
      in.dim = d + 1;
      in.layer = {};
      out.update = lifted_update.data();
      attend_factored(in, factored, out, options);
      for (std::int64_t r = 0; r < rows; ++r) {
        std::copy(lifted_update.begin() + r * (d + 1), lifted_update.begin() + r * (d + 1) + d,
                  update.begin() + r * d);
      }
    } else if (settings.factored) {
      const Factors<T> f(layer.attention, model.kv_heads);
      FactoredLayer<T> factored;
      factored.heads = H;
      factored.rank = model.head_dim;
      factored.query_factor = f.a.data();
      factored.key_factor = f.b.data();
      factored.content_up = f.up.data();
      factored.content_down = f.down.data();
      factored.key_bias = u.empty() ? nullptr : u.data();
      factored.offset = c.empty() ? nullptr : c.data();
      if (llama) {
        factored.kv_heads = model.key_heads();
        factored.rotary = rotary;
      }
      in.layer = {};
      attend_factored(in, factored, out, options);
    } else {
      attend(in, out, options);
    }
    std::copy(update.begin(), update.end(), trace.attention.data() + l * rows * d);
    for (std::int64_t b = 0; b < B; ++b) {
      const std::int64_t n = length_of(b);
      double sum = 0.0;
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t i = 0; i < n; ++i)
          sum += entropy[static_cast<std::size_t>((b * H + h) * N + i)];
      trace.observables[static_cast<std::size_t>(l * B + b)].entropy =
          sum / static_cast<double>(H * n);
    }
    for (std::size_t k = 0; k < x.size(); ++k) x[k] += update[k];
    if (!pre) layer_norm(x, rows, d, layer.norm1_gain, layer.norm1_bias, model.norm_eps);
    if (settings.full_layer && llama) {
      normed = x;
      rms_norm(normed.data(), rows, d, layer.norm2_gain, model.norm_eps);
      if constexpr (std::is_same_v<T, float>) {
        if (layers::float_products()) {
          std::vector<float> scratch;
          layers::GatedFeedForward32(layer, model.activation, d)(normed.data(), ffn.data(), rows,
                                                                 options.threads, scratch);
        } else {
          gated_feed_forward(layer, model.activation, normed.data(), ffn.data(), rows, d);
        }
      } else {
        gated_feed_forward(layer, model.activation, normed.data(), ffn.data(), rows, d);
      }
      for (std::size_t k = 0; k < x.size(); ++k) x[k] += ffn[k];
    } else if (settings.full_layer) {
      if (pre) {
        normed = x;
        layer_norm(normed, rows, d, layer.norm2_gain, layer.norm2_bias, model.norm_eps);
        feed_forward(layer, model.activation, normed.data(), ffn.data(), rows, d);
      } else {
        feed_forward(layer, model.activation, x.data(), ffn.data(), rows, d);
      }
      for (std::size_t k = 0; k < x.size(); ++k) x[k] += ffn[k];
      if (!pre) layer_norm(x, rows, d, layer.norm2_gain, layer.norm2_bias, model.norm_eps);
    }
    if (l == L - 1 && !llama && model.final_gain.size() > 0) {
      layer_norm(x, rows, d, model.final_gain, model.final_bias, model.norm_eps);
    }
    record(l + 1);
  }
  return trace;
}

template <class T>
Tensor<T> next_token_logits(const Model& model, const Tensor<T>& clouds,
                            const std::vector<std::int64_t>& key_lengths) {
  const char* op = "next_token_logits";
  const Tensor<double>& w = model.output_matrix();
  if (w.rank() != 2 || w.extent(1) != model.dim) {
    fail_argument(op, "model", "has no unembedding (", to_string(model.layout),
                  " layout); next-token logits need a model that has one (llama)");
  }
  if (clouds.rank() != 3 || clouds.extent(2) != model.dim || clouds.extent(1) < 1) {
    fail_argument(op, "clouds", "has shape ", emflow::to_string(clouds.shape()),
                  ", expected (B, N, ", model.dim, ") with N >= 1 (d of the model)");
  }
  const std::int64_t B = clouds.extent(0), N = clouds.extent(1), d = model.dim;
  const std::int64_t V = w.extent(0);
  if (!key_lengths.empty() && static_cast<std::int64_t>(key_lengths.size()) != B) {
    fail_argument(op, "key_lengths", "has ", key_lengths.size(), " entries, expected ", B,
                  " (one per cloud)");
  }
  Tensor<T> logits(Shape{B, V});
  for (std::int64_t b = 0; b < B; ++b) {
    const std::int64_t n = key_lengths.empty() ? N : key_lengths[static_cast<std::size_t>(b)];
    if (n < 1 || n > N) fail_argument(op, "key_lengths", "holds ", n, ", expected 1..", N);
    const T* last = clouds.data() + (b * N + n - 1) * d;
    std::vector<double> h(last, last + d);
    if (model.layout == Layout::llama) {
      rms_norm(h.data(), 1, d, model.final_gain, model.norm_eps);
    }
    T* out = logits.data() + b * V;
#pragma omp parallel for schedule(static) if (V * d > (1 << 20))
    for (std::int64_t t = 0; t < V; ++t) {
      const double* row = w.data() + t * d;
      double s = 0.0;
      for (std::int64_t a = 0; a < d; ++a) s += row[a] * h[static_cast<std::size_t>(a)];
      out[t] = static_cast<T>(s);
    }
  }
  return logits;
}

template Tensor<float> next_token_logits<float>(const Model&, const Tensor<float>&,
                                                const std::vector<std::int64_t>&);
template Tensor<double> next_token_logits<double>(const Model&, const Tensor<double>&,
                                                  const std::vector<std::int64_t>&);

template ModelTrace<float> run_model<float>(const Model&, const Tensor<float>&,
                                            const std::vector<std::int64_t>&, const RunSettings&,
                                            const ExecutionOptions&);
template ModelTrace<double> run_model<double>(const Model&, const Tensor<double>&,
                                              const std::vector<std::int64_t>&, const RunSettings&,
                                              const ExecutionOptions&);

}  // namespace emflow::model
