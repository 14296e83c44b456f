// Running a converted model's layers on token clouds: attention through emflow::attend with the
// layer's EMF operators, then the residual, the layer norms (with the model's eps) and the
// feed-forward block in the order of the model's layout (emflow/model.hpp).
#include <algorithm>
#include <cmath>

#include "core/check.hpp"
#include "emflow/factored.hpp"
#include "emflow/model.hpp"

namespace emflow::model {
namespace {

using detail::fail_argument;

double activate(Activation activation, double x) {
  switch (activation) {
    case Activation::gelu:
      return 0.5 * x * (1.0 + std::erf(x / std::sqrt(2.0)));
    case Activation::gelu_tanh: {
      const double k = std::sqrt(2.0 / 3.14159265358979323846);
      return 0.5 * x * (1.0 + std::tanh(k * (x + 0.044715 * x * x * x)));
    }
    case Activation::relu:
      break;
  }
  return x > 0 ? x : 0.0;
}

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
std::vector<T> cast(const Tensor<double>& t) {
  return std::vector<T>(t.values().begin(), t.values().end());
}

// The factored form of a layer's attention (emflow/factored.hpp), heads one after another.
template <class T>
struct Factors {
  std::vector<T> a, b, up, down;

  explicit Factors(const MultiHeadAttentionWeights& w) {
    const std::int64_t H = w.heads, d = w.model_dim, k = w.head_dim, v = w.value_dim;
    const double scale = 1.0 / std::sqrt(static_cast<double>(k));
    for (std::int64_t i = 0; i < H * k * d; ++i) {
      a.push_back(static_cast<T>(w.query[i] * scale));
      b.push_back(static_cast<T>(w.key[i]));
    }
    for (std::int64_t h = 0; h < H; ++h) {
      for (std::int64_t r = 0; r < d; ++r)
        for (std::int64_t c = 0; c < v; ++c)
          up.push_back(static_cast<T>(w.output[r * H * v + h * v + c]));
    }
    for (std::int64_t i = 0; i < H * v * d; ++i) down.push_back(static_cast<T>(w.value[i]));
  }
};

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
    if (pre) {
      normed = x;
      layer_norm(normed, rows, d, layer.norm1_gain, layer.norm1_bias, model.norm_eps);
    }
    AttentionInput<T> in;
    in.cloud = pre ? normed.data() : x.data();
    in.batch = B;
    in.tokens = N;
    in.dim = d;
    in.layer = {H, M.data(), F.data(), u.data(), c.data()};
    in.mask = model.causal ? Mask::causal() : Mask::none();
    in.key_lengths = key_lengths.empty() ? nullptr : key_lengths.data();
    AttentionOutput<T> out;
    out.update = update.data();
    out.entropy = entropy.data();
    if (settings.factored) {
      const Factors<T> f(layer.attention);
      FactoredLayer<T> factored;
      factored.heads = H;
      factored.rank = model.head_dim;
      factored.query_factor = f.a.data();
      factored.key_factor = f.b.data();
      factored.content_up = f.up.data();
      factored.content_down = f.down.data();
      factored.key_bias = u.data();
      factored.offset = c.data();
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
    if (settings.full_layer) {
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
    if (l == L - 1 && model.final_gain.size() > 0) {
      layer_norm(x, rows, d, model.final_gain, model.final_bias, model.norm_eps);
    }
    record(l + 1);
  }
  return trace;
}

template ModelTrace<float> run_model<float>(const Model&, const Tensor<float>&,
                                            const std::vector<std::int64_t>&, const RunSettings&,
                                            const ExecutionOptions&);
template ModelTrace<double> run_model<double>(const Model&, const Tensor<double>&,
                                              const std::vector<std::int64_t>&, const RunSettings&,
                                              const ExecutionOptions&);

}  // namespace emflow::model
