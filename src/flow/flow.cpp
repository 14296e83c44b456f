// The flow of token clouds (REFERENCE.md §4): generators, normalisations, the attention update
// (SA / USA, tangent projection), the Euler and RK4 steps and the recorded run. On the host
// every attention evaluation is one emflow::attend call per run of clouds sharing beta and the
// rest is element-wise work on the host; a run whose device resolves to CUDA goes to the
// device-resident run_flow_cuda (kernels/flow_cuda.cpp) after the same validation.
#include "emflow/flow.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>

#include "../core/check.hpp"
#include "../core/parallel.hpp"
#include "emflow/mha.hpp"
#include "internal.hpp"

#if EMFLOW_WITH_CUDA
#include "kernels/flow_cuda.hpp"
#endif

namespace emflow::flow {

using emflow::detail::fail_argument;

namespace detail {

namespace {
std::uint64_t splitmix64(std::uint64_t x) noexcept {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
}  // namespace

std::uint64_t mix_seed(std::uint64_t seed, std::uint64_t stream) noexcept {
  return splitmix64(splitmix64(seed) + stream);
}

template <class T>
void StepWorkspace<T>::resize(std::size_t size) {
  for (auto* v : {&k1, &k2, &k3, &k4, &stage}) v->resize(size);
}

std::int64_t continuous_steps(double time, double dt) noexcept {
  // The small slack keeps T = 30, dt = 0.1 at 300 steps despite 30 / 0.1 rounding above 300.
  return std::max<std::int64_t>(1, static_cast<std::int64_t>(std::ceil(time / dt - 1e-9)));
}

double step_length(double time, double dt, std::int64_t steps, std::int64_t s) noexcept {
  return s + 1 < steps ? dt : time - dt * static_cast<double>(steps - 1);
}

}  // namespace detail

// ---------------------------------------------------------------------------------------------
// Names

Normalization parse_normalization(const std::string& text, const char* argument) {
  if (text == "none") return Normalization::none;
  if (text == "layernorm") return Normalization::layernorm;
  if (text == "rmsnorm") return Normalization::rmsnorm;
  if (text == "sphere") return Normalization::sphere;
  fail_argument("flow", argument, "expects none, layernorm, rmsnorm or sphere, got '", text, "'");
}

Integrator parse_integrator(const std::string& text, const char* argument) {
  if (text == "euler") return Integrator::euler;
  if (text == "rk4") return Integrator::rk4;
  fail_argument("flow", argument, "expects euler or rk4, got '", text, "'");
}

InitialCloud parse_initial_cloud(const std::string& text, const char* argument) {
  if (text == "gaussian") return InitialCloud::gaussian;
  if (text == "sphere") return InitialCloud::sphere;
  if (text == "cube") return InitialCloud::cube;
  if (text == "orthonormal") return InitialCloud::orthonormal;
  fail_argument("flow", argument, "expects gaussian, sphere, cube or orthonormal, got '", text,
                "'");
}

OperatorKind parse_operator_kind(const std::string& text, const char* argument) {
  if (text == "identity") return OperatorKind::identity;
  if (text == "minus-identity") return OperatorKind::minus_identity;
  if (text == "random") return OperatorKind::random;
  fail_argument("flow", argument, "expects identity, minus-identity or random, got '", text, "'");
}

const char* to_string(Normalization value) noexcept {
  switch (value) {
    case Normalization::layernorm:
      return "layernorm";
    case Normalization::rmsnorm:
      return "rmsnorm";
    case Normalization::sphere:
      return "sphere";
    case Normalization::none:
      break;
  }
  return "none";
}

const char* to_string(Integrator value) noexcept {
  return value == Integrator::euler ? "euler" : "rk4";
}

// ---------------------------------------------------------------------------------------------
// Operators and initial clouds

template <class T>
LayerOperators<T> FlowLayer<T>::operators() const {
  LayerOperators<T> ops;
  ops.heads = heads;
  ops.relevance = relevance.data();
  ops.content = content.data();
  ops.key_bias = key_bias.empty() ? nullptr : key_bias.data();
  ops.offset = offset.empty() ? nullptr : offset.data();
  return ops;
}

template <class T>
std::vector<T> make_operator(OperatorKind kind, std::int64_t dim, std::uint64_t seed) {
  emflow::detail::expect_positive("make_operator", "dim", dim);
  const auto d = static_cast<std::size_t>(dim);
  std::vector<T> op(d * d, T(0));
  if (kind == OperatorKind::random) {
    std::mt19937_64 engine(seed);
    std::normal_distribution<double> normal(0.0, 1.0 / std::sqrt(static_cast<double>(dim)));
    for (T& v : op) v = static_cast<T>(normal(engine));
  } else {
    const T diagonal = kind == OperatorKind::identity ? T(1) : T(-1);
    for (std::size_t a = 0; a < d; ++a) op[a * d + a] = diagonal;
  }
  return op;
}

template <class T>
FlowLayer<T> make_layer(std::int64_t dim, OperatorKind relevance, OperatorKind content,
                        std::uint64_t seed) {
  FlowLayer<T> layer;
  layer.relevance = make_operator<T>(relevance, dim, detail::mix_seed(seed, 1));
  layer.content = make_operator<T>(content, dim, detail::mix_seed(seed, 2));
  return layer;
}

template <class T>
FlowLayer<T> layer_from_mha(const MultiHeadAttentionWeights& weights) {
  const reference::Layer emf = to_emf(weights);
  auto cast = [](const Tensor<double>& t) {
    return std::vector<T>(t.values().begin(), t.values().end());
  };
  FlowLayer<T> layer;
  layer.heads = emf.heads();
  layer.relevance = cast(emf.relevance);
  layer.content = cast(emf.content);
  layer.key_bias = cast(emf.key_bias);
  layer.offset = cast(emf.offset);
  return layer;
}

template <class T>
Tensor<T> initial_clouds(InitialCloud kind, std::int64_t batch, std::int64_t tokens,
                         std::int64_t dim, std::uint64_t seed) {
  const char* op = "initial_clouds";
  emflow::detail::expect_positive(op, "batch", batch);
  emflow::detail::expect_positive(op, "tokens", tokens);
  emflow::detail::expect_positive(op, "dim", dim);
  if (kind == InitialCloud::orthonormal && tokens > dim) {
    fail_argument(op, "tokens", "must be <= dim (", dim, ") for orthonormal clouds, got ", tokens);
  }
  Tensor<T> clouds({batch, tokens, dim});
  const auto d = static_cast<std::size_t>(dim);
  std::vector<double> x(static_cast<std::size_t>(tokens) * d);
  for (std::int64_t b = 0; b < batch; ++b) {
    std::mt19937_64 engine(detail::mix_seed(seed, static_cast<std::uint64_t>(b)));
    std::normal_distribution<double> normal(0.0, 1.0);
    std::uniform_real_distribution<double> uniform(-1.0, 1.0);
    if (kind == InitialCloud::cube) {
      for (double& v : x) v = uniform(engine);
    } else {
      for (double& v : x) v = normal(engine);
    }
    for (std::int64_t i = 0; i < tokens; ++i) {
      double* row = x.data() + static_cast<std::size_t>(i) * d;
      if (kind == InitialCloud::gaussian) {
        for (std::size_t a = 0; a < d; ++a) row[a] /= std::sqrt(static_cast<double>(dim));
      } else if (kind == InitialCloud::orthonormal) {
        // Modified Gram-Schmidt, twice: one pass leaves O(eps * condition) loss of
        // orthogonality, two leave rounding.
        for (int pass = 0; pass < 2; ++pass) {
          for (std::int64_t k = 0; k < i; ++k) {
            const double* prev = x.data() + static_cast<std::size_t>(k) * d;
            double dot = 0.0;
            for (std::size_t a = 0; a < d; ++a) dot += row[a] * prev[a];
            for (std::size_t a = 0; a < d; ++a) row[a] -= dot * prev[a];
          }
        }
      }
      if (kind == InitialCloud::sphere || kind == InitialCloud::orthonormal) {
        double norm = 0.0;
        for (std::size_t a = 0; a < d; ++a) norm += row[a] * row[a];
        norm = std::sqrt(norm);
        for (std::size_t a = 0; a < d; ++a) row[a] /= norm;
      }
    }
    std::copy(x.begin(), x.end(), clouds.data() + static_cast<std::size_t>(b) * x.size());
  }
  return clouds;
}

// ---------------------------------------------------------------------------------------------
// Normalisation

template <class T>
void normalize(Normalization norm, T* tokens, std::int64_t rows, std::int64_t dim, const T* gain,
               const T* bias) {
  if (norm == Normalization::none) return;
  constexpr double eps = 1e-5;  // as in PyTorch's LayerNorm / RMSNorm defaults
  const double inv_dim = 1.0 / static_cast<double>(dim);
#pragma omp parallel for schedule(static) if (rows * dim > 32768)
  for (std::int64_t r = 0; r < rows; ++r) {
    T* x = tokens + r * dim;
    double shift = 0.0, scale = 1.0;
    if (norm == Normalization::layernorm) {
      double mean = 0.0, var = 0.0;
      for (std::int64_t a = 0; a < dim; ++a) mean += static_cast<double>(x[a]);
      mean *= inv_dim;
      for (std::int64_t a = 0; a < dim; ++a) {
        const double c = static_cast<double>(x[a]) - mean;
        var += c * c;
      }
      shift = mean;
      scale = 1.0 / std::sqrt(var * inv_dim + eps);
    } else {
      double square = 0.0;
      for (std::int64_t a = 0; a < dim; ++a) square += static_cast<double>(x[a]) * x[a];
      if (norm == Normalization::rmsnorm) {
        scale = 1.0 / std::sqrt(square * inv_dim + eps);
      } else {
        // A zero token has no direction: it stays where it is rather than becoming NaN.
        scale = square > 0.0 ? 1.0 / std::sqrt(square) : 1.0;
      }
    }
    for (std::int64_t a = 0; a < dim; ++a) {
      double v = (static_cast<double>(x[a]) - shift) * scale;
      if (norm != Normalization::sphere) {
        if (gain) v *= static_cast<double>(gain[a]);
        if (norm == Normalization::layernorm && bias) v += static_cast<double>(bias[a]);
      }
      x[a] = static_cast<T>(v);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The attention update

template <class T>
void attention_update(const T* cloud, std::int64_t batch, std::int64_t tokens, std::int64_t dim,
                      const FlowLayer<T>& layer, const std::vector<double>& betas,
                      const UpdateSettings& settings, T* update, double* mean_entropy,
                      const ExecutionOptions& options) {
  if (static_cast<std::int64_t>(betas.size()) != batch) {
    fail_argument("attention_update", "betas", "must have one entry per cloud (", batch, "), got ",
                  betas.size());
  }
  const std::int64_t H = layer.heads, N = tokens, d = dim, B = batch;
  const std::int64_t rows = B * N;
  std::vector<T> lse(static_cast<std::size_t>(B * H * N));
  std::vector<T> entropy(lse.size());
  const LayerOperators<T> ops = layer.operators();
  // A small batch runs attend on one thread. A flow makes 4 attend calls per RK4 step, and each
  // call's OpenMP team costs a fork and a join whose spinning threads stall as soon as another
  // process holds a core: measured for N = d = 128 on the 2-core machine while it compiled,
  // 150 RK4 steps took 1 to 7 s with 2 threads and 0.3 s with one. Below about 4M N^2 d units
  // (16 MFLOP, a millisecond on one core) the second core gains too little to risk that.
  ExecutionOptions run = options;
  if (run.threads == 0 && B * H * N * N * d < (std::int64_t{1} << 22)) run.threads = 1;

  // Calls attend on each run [b0, b1) of consecutive clouds with one beta.
  auto attend_runs = [&](const LayerOperators<T>& head_ops, std::int64_t heads, T* delta,
                         T* run_lse, T* run_entropy) {
    for (std::int64_t b0 = 0; b0 < B;) {
      const std::int64_t b1 = detail::beta_run_end(betas, b0);
      AttentionInput<T> in;
      in.cloud = cloud + b0 * N * d;
      in.batch = b1 - b0;
      in.tokens = N;
      in.dim = d;
      in.layer = head_ops;
      in.beta = betas[static_cast<std::size_t>(b0)];
      AttentionOutput<T> out;
      out.update = delta + b0 * N * d;
      out.lse = run_lse + b0 * heads * N;
      out.entropy = run_entropy + b0 * heads * N;
      attend(in, out, run);
      b0 = b1;
    }
  };

  const double log_n = std::log(static_cast<double>(N));
  if (!settings.unnormalized) {
    attend_runs(ops, H, update, lse.data(), entropy.data());
  } else {
    // USA: sum_j exp(s_ij) F x_j / N = delta_i * Z_i / N, Z_i = exp(lse_i). Each head has its
    // own Z_i, so several heads are evaluated one at a time; c is a constant drift, unscaled.
    std::vector<T> delta(static_cast<std::size_t>(rows * d));
    std::vector<T> head_lse(static_cast<std::size_t>(rows)), head_entropy(head_lse.size());
    std::fill(update, update + rows * d, T(0));
    for (std::int64_t h = 0; h < H; ++h) {
      LayerOperators<T> head = ops;
      head.heads = 1;
      head.relevance = ops.relevance + h * d * d;
      head.content = ops.content + h * d * d;
      head.key_bias = ops.key_bias ? ops.key_bias + h * d : nullptr;
      head.offset = nullptr;
      attend_runs(head, 1, delta.data(), head_lse.data(), head_entropy.data());
#pragma omp parallel for schedule(static) if (rows * d > 32768)
      for (std::int64_t r = 0; r < rows; ++r) {
        const double scale = std::exp(static_cast<double>(head_lse[r]) - log_n);
        for (std::int64_t a = 0; a < d; ++a) {
          update[r * d + a] += static_cast<T>(scale * static_cast<double>(delta[r * d + a]));
        }
        const std::int64_t b = r / N, i = r % N;
        lse[(b * H + h) * N + i] = head_lse[r];
        entropy[(b * H + h) * N + i] = head_entropy[r];
      }
    }
    if (ops.offset) {
      for (std::int64_t r = 0; r < rows; ++r)
        for (std::int64_t a = 0; a < d; ++a) update[r * d + a] += ops.offset[a];
    }
  }

  if (settings.tangent) {
    // P_x y = y - <x, y> x: the part of the update that moves along the sphere.
#pragma omp parallel for schedule(static) if (rows * d > 32768)
    for (std::int64_t r = 0; r < rows; ++r) {
      const T* x = cloud + r * d;
      T* y = update + r * d;
      double dot = 0.0;
      for (std::int64_t a = 0; a < d; ++a) dot += static_cast<double>(x[a]) * y[a];
      for (std::int64_t a = 0; a < d; ++a) y[a] = static_cast<T>(y[a] - dot * x[a]);
    }
  }

  if (mean_entropy) {
    for (std::int64_t b = 0; b < B; ++b) {
      double sum = 0.0;
      for (std::int64_t k = 0; k < H * N; ++k) sum += static_cast<double>(entropy[b * H * N + k]);
      mean_entropy[b] = sum / static_cast<double>(H * N);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Steps

namespace detail {

namespace {
// y = x + h * k, element-wise.
template <class T>
void axpy_to(T* y, const T* x, const T* k, double h, std::size_t n) {
  const T step = static_cast<T>(h);
#pragma omp parallel for schedule(static) if (n > 65536)
  for (std::size_t e = 0; e < n; ++e) y[e] = x[e] + step * k[e];
}
}  // namespace

template <class T>
void continuous_step(T* cloud, std::int64_t batch, std::int64_t tokens, std::int64_t dim,
                     const FlowLayer<T>& layer, const std::vector<double>& betas,
                     const UpdateSettings& settings, Integrator integrator, double h,
                     StepWorkspace<T>& w, double* mean_entropy, const ExecutionOptions& options) {
  const auto n = static_cast<std::size_t>(batch * tokens * dim);
  w.resize(n);
  auto drift = [&](const T* x, T* k, double* entropy) {
    attention_update(x, batch, tokens, dim, layer, betas, settings, k, entropy, options);
  };
  drift(cloud, w.k1.data(), mean_entropy);
  if (integrator == Integrator::euler) {
    axpy_to(cloud, cloud, w.k1.data(), h, n);
  } else {
    axpy_to(w.stage.data(), cloud, w.k1.data(), h / 2, n);
    drift(w.stage.data(), w.k2.data(), nullptr);
    axpy_to(w.stage.data(), cloud, w.k2.data(), h / 2, n);
    drift(w.stage.data(), w.k3.data(), nullptr);
    axpy_to(w.stage.data(), cloud, w.k3.data(), h, n);
    drift(w.stage.data(), w.k4.data(), nullptr);
    const T sixth = static_cast<T>(h / 6);
#pragma omp parallel for schedule(static) if (n > 65536)
    for (std::size_t e = 0; e < n; ++e) {
      cloud[e] += sixth * (w.k1[e] + T(2) * (w.k2[e] + w.k3[e]) + w.k4[e]);
    }
  }
  if (settings.tangent) normalize(Normalization::sphere, cloud, batch * tokens, dim);
}

}  // namespace detail

// ---------------------------------------------------------------------------------------------
// The recorded run

std::int64_t step_count(const FlowSettings& s) {
  return s.layers > 0 ? s.layers : detail::continuous_steps(s.time, s.dt);
}

namespace {

template <class T>
void validate_layer(const FlowLayer<T>& layer, std::int64_t d, std::size_t index) {
  const char* op = "run_flow";
  const std::int64_t H = layer.heads;
  if (H < 1) fail_argument(op, "layers", "layer ", index, ": heads must be >= 1, got ", H);
  auto expect = [&](const char* name, std::size_t size, std::int64_t want, bool optional) {
    if ((optional && size == 0) || static_cast<std::int64_t>(size) == want) return;
    fail_argument(op, "layers", "layer ", index, ": ", name, " has ", size, " entries, expected ",
                  want, optional ? " or none" : "");
  };
  expect("relevance", layer.relevance.size(), H * d * d, false);
  expect("content", layer.content.size(), H * d * d, false);
  expect("key_bias", layer.key_bias.size(), H * d, true);
  expect("offset", layer.offset.size(), d, true);
  expect("norm_gain", layer.norm_gain.size(), d, true);
  expect("norm_bias", layer.norm_bias.size(), d, true);
}

}  // namespace

namespace detail {

template <class T>
std::vector<double> validate_flow(const Tensor<T>& initial, const std::vector<double>& betas_in,
                                  const std::vector<FlowLayer<T>>& layers,
                                  const FlowSettings& settings) {
  const char* op = "run_flow";
  if (initial.rank() != 3) {
    fail_argument(op, "initial", "must have shape (batch, tokens, dim), got ",
                  emflow::to_string(initial.shape()));
  }
  const std::int64_t B = initial.extent(0), N = initial.extent(1), d = initial.extent(2);
  emflow::detail::expect_positive(op, "batch", B);
  if (N < 2) fail_argument(op, "tokens", "must be >= 2 (the observables are pairwise), got ", N);
  emflow::detail::expect_positive(op, "dim", d);

  std::vector<double> betas = betas_in;
  if (betas.size() == 1) betas.assign(static_cast<std::size_t>(B), betas_in[0]);
  if (static_cast<std::int64_t>(betas.size()) != B) {
    fail_argument(op, "betas", "must have 1 or batch (", B, ") entries, got ", betas_in.size());
  }
  for (double beta : betas) {
    if (!(std::isfinite(beta) && beta > 0.0)) {
      fail_argument(op, "beta", "must be finite and > 0, got ", beta);
    }
  }

  const bool continuous = settings.layers == 0;
  if (settings.layers < 0) fail_argument(op, "layers", "must be >= 0, got ", settings.layers);
  if (continuous) {
    if (!(std::isfinite(settings.time) && settings.time > 0.0)) {
      fail_argument(op, "time", "must be finite and > 0, got ", settings.time);
    }
    if (!(std::isfinite(settings.dt) && settings.dt > 0.0)) {
      fail_argument(op, "dt", "must be finite and > 0, got ", settings.dt);
    }
    if (settings.time / settings.dt > 1e8) {
      fail_argument(op, "dt", "gives more than 1e8 steps (time ", settings.time, ", dt ",
                    settings.dt, ")");
    }
    if (settings.norm != Normalization::none && settings.norm != Normalization::sphere) {
      fail_argument(op, "norm", "must be none or sphere in continuous time, got ",
                    to_string(settings.norm));
    }
    if (settings.pre_norm) fail_argument(op, "pre_norm", "applies to a stack of layers only");
    if (layers.size() != 1) {
      fail_argument(op, "layers", "continuous time takes exactly 1 layer, got ", layers.size());
    }
  } else if (layers.size() != 1 && static_cast<std::int64_t>(layers.size()) != settings.layers) {
    fail_argument(op, "layers", "must hold 1 or ", settings.layers, " layers, got ", layers.size());
  }
  for (std::size_t l = 0; l < layers.size(); ++l) validate_layer(layers[l], d, l);
  if (settings.record_every < 1) {
    fail_argument(op, "record_every", "must be >= 1, got ", settings.record_every);
  }
  if (!(settings.cluster_eps > 0.0 && settings.cluster_eps < 2.0)) {
    fail_argument(op, "cluster_eps", "must be in (0, 2), got ", settings.cluster_eps);
  }
  return betas;
}

std::int64_t record_count(std::int64_t steps, std::int64_t every) noexcept {
  return steps / every + 1 + (steps % every != 0 ? 1 : 0);
}

template <class T>
FlowResult<T> allocate_result(std::int64_t batch, std::int64_t tokens, std::int64_t dim,
                              const FlowSettings& settings) {
  const std::int64_t R = record_count(step_count(settings), settings.record_every);
  // Refuse trajectories beyond 2^31 elements (8 GiB in double) before allocating.
  const Shape shape{R, batch, tokens, dim};
  checked_element_count(shape, "trajectory", std::int64_t{1} << 31);
  FlowResult<T> result;
  result.trajectory = Tensor<T>(shape);
  result.times.resize(static_cast<std::size_t>(R));
  result.steps.resize(static_cast<std::size_t>(R));
  result.observables.resize(static_cast<std::size_t>(R * batch));
  return result;
}

}  // namespace detail

template <class T>
FlowResult<T> run_flow(const Tensor<T>& initial, const std::vector<double>& betas_in,
                       const std::vector<FlowLayer<T>>& layers, const FlowSettings& settings,
                       const ExecutionOptions& options, const Progress& progress) {
  const std::vector<double> betas = detail::validate_flow(initial, betas_in, layers, settings);
  if (options.threads < 0) {
    fail_argument("run_flow", "threads", "must be >= 0, got ", options.threads);
  }
  // Throws ErrorCode::unsupported, with the reason, when cuda is asked for but unusable.
  if (resolve_device(options.device) == Device::cuda) {
#if EMFLOW_WITH_CUDA
    // The whole run stays on the device: attention, steps and observables.
    return detail::run_flow_cuda(initial, betas, layers, settings, progress);
#endif
  }
  const std::int64_t B = initial.extent(0), N = initial.extent(1), d = initial.extent(2);
  const bool continuous = settings.layers == 0;
  const std::int64_t S = step_count(settings);
  const std::int64_t k = settings.record_every;
  FlowResult<T> result = detail::allocate_result<T>(B, N, d, settings);

  Tensor<T> state = initial;
  T* x = state.data();
  const bool sphere = settings.norm == Normalization::sphere;
  if (continuous && sphere) normalize(Normalization::sphere, x, B * N, d);

  UpdateSettings update_settings;
  update_settings.unnormalized = settings.unnormalized;
  update_settings.tangent = continuous && sphere;
  detail::StepWorkspace<T> workspace;
  std::vector<T> delta(static_cast<std::size_t>(B * N * d)), normed;
  std::vector<double> entropy(static_cast<std::size_t>(B));
  auto layer_of = [&](std::int64_t s) -> const FlowLayer<T>& {
    return layers[layers.size() == 1 ? 0 : static_cast<std::size_t>(s)];
  };

  double t = 0.0;
  std::int64_t r = 0;
  for (std::int64_t s = 0;; ++s) {
    const bool record = s % k == 0 || s == S;
    if (record) {
      std::copy(x, x + B * N * d, result.trajectory.data() + r * B * N * d);
      result.times[static_cast<std::size_t>(r)] = continuous ? t : static_cast<double>(s);
      result.steps[static_cast<std::size_t>(r)] = s;
      ::emflow::detail::ParallelErrors errors;  // observe() allocates
#pragma omp parallel for schedule(dynamic) if (B > 1 && B * N * N * d > (1 << 16))
      for (std::int64_t b = 0; b < B; ++b) {
        errors.run([&] {
          result.observables[static_cast<std::size_t>(r * B + b)] = observe(
              x + b * N * d, N, d, betas[static_cast<std::size_t>(b)], settings.cluster_eps);
        });
      }
      errors.rethrow();
    }
    if (s == S) {
      // The entropy of the final state: one more evaluation (the last layer's operators).
      const FlowLayer<T>& last = layer_of(continuous ? 0 : S - 1);
      const T* at = x;
      if (!continuous && settings.pre_norm) {
        normed.assign(x, x + B * N * d);
        normalize(settings.norm, normed.data(), B * N, d,
                  last.norm_gain.empty() ? nullptr : last.norm_gain.data(),
                  last.norm_bias.empty() ? nullptr : last.norm_bias.data());
        at = normed.data();
      }
      attention_update(at, B, N, d, last, betas, update_settings, delta.data(), entropy.data(),
                       options);
      for (std::int64_t b = 0; b < B; ++b) {
        result.observables[static_cast<std::size_t>(r * B + b)].entropy =
            entropy[static_cast<std::size_t>(b)];
      }
      break;
    }

    if (continuous) {
      const double h = detail::step_length(settings.time, settings.dt, S, s);
      detail::continuous_step(x, B, N, d, layers[0], betas, update_settings, settings.integrator, h,
                              workspace, entropy.data(), options);
      t += h;
    } else {
      const FlowLayer<T>& layer = layer_of(s);
      const T* gain = layer.norm_gain.empty() ? nullptr : layer.norm_gain.data();
      const T* bias = layer.norm_bias.empty() ? nullptr : layer.norm_bias.data();
      if (settings.pre_norm) {
        normed.assign(x, x + B * N * d);
        normalize(settings.norm, normed.data(), B * N, d, gain, bias);
        attention_update(normed.data(), B, N, d, layer, betas, update_settings, delta.data(),
                         entropy.data(), options);
        for (std::int64_t e = 0; e < B * N * d; ++e) x[e] += delta[static_cast<std::size_t>(e)];
      } else {
        attention_update(x, B, N, d, layer, betas, update_settings, delta.data(), entropy.data(),
                         options);
        for (std::int64_t e = 0; e < B * N * d; ++e) x[e] += delta[static_cast<std::size_t>(e)];
        normalize(settings.norm, x, B * N, d, gain, bias);
      }
    }
    if (record) {
      for (std::int64_t b = 0; b < B; ++b) {
        result.observables[static_cast<std::size_t>(r * B + b)].entropy =
            entropy[static_cast<std::size_t>(b)];
      }
      ++r;
    }
    if (progress) progress(s + 1, S);
  }
  return result;
}

// ---------------------------------------------------------------------------------------------
// Explicit instantiations: float and double only.

#define EMFLOW_FLOW_INSTANTIATE(T)                                                                \
  template struct FlowLayer<T>;                                                                   \
  template std::vector<T> make_operator<T>(OperatorKind, std::int64_t, std::uint64_t);            \
  template FlowLayer<T> make_layer<T>(std::int64_t, OperatorKind, OperatorKind, std::uint64_t);   \
  template FlowLayer<T> layer_from_mha<T>(const MultiHeadAttentionWeights&);                      \
  template Tensor<T> initial_clouds<T>(InitialCloud, std::int64_t, std::int64_t, std::int64_t,    \
                                       std::uint64_t);                                            \
  template void normalize<T>(Normalization, T*, std::int64_t, std::int64_t, const T*, const T*);  \
  template void attention_update<T>(const T*, std::int64_t, std::int64_t, std::int64_t,           \
                                    const FlowLayer<T>&, const std::vector<double>&,              \
                                    const UpdateSettings&, T*, double*, const ExecutionOptions&); \
  template struct detail::StepWorkspace<T>;                                                       \
  template void detail::continuous_step<T>(                                                       \
      T*, std::int64_t, std::int64_t, std::int64_t, const FlowLayer<T>&,                          \
      const std::vector<double>&, const UpdateSettings&, Integrator, double,                      \
      detail::StepWorkspace<T>&, double*, const ExecutionOptions&);                               \
  template FlowResult<T> run_flow<T>(const Tensor<T>&, const std::vector<double>&,                \
                                     const std::vector<FlowLayer<T>>&, const FlowSettings&,       \
                                     const ExecutionOptions&, const Progress&);                   \
  template std::vector<double> detail::validate_flow<T>(                                          \
      const Tensor<T>&, const std::vector<double>&, const std::vector<FlowLayer<T>>&,             \
      const FlowSettings&);                                                                       \
  template FlowResult<T> detail::allocate_result<T>(std::int64_t, std::int64_t, std::int64_t,     \
                                                    const FlowSettings&);

EMFLOW_FLOW_INSTANTIATE(float)
EMFLOW_FLOW_INSTANTIATE(double)
#undef EMFLOW_FLOW_INSTANTIATE

}  // namespace emflow::flow
