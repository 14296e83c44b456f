#include "common/flow_helpers.hpp"

#include <algorithm>
#include <cmath>

#include "common/testing.hpp"

namespace emflow::testing {

ExecutionOptions on(Device device, int threads) {
  ExecutionOptions options;
  options.device = device;
  options.threads = threads;
  return options;
}

flow::FlowSettings continuous(double time, double dt, flow::Integrator integrator, bool sphere) {
  flow::FlowSettings s;
  s.layers = 0;
  s.time = time;
  s.dt = dt;
  s.integrator = integrator;
  s.norm = sphere ? flow::Normalization::sphere : flow::Normalization::none;
  return s;
}

flow::FlowSettings stack(std::int64_t layers, flow::Normalization norm, bool pre_norm) {
  flow::FlowSettings s;
  s.layers = layers;
  s.norm = norm;
  s.pre_norm = pre_norm;
  return s;
}

std::vector<flow::Normalization> every_normalization() {
  return {flow::Normalization::none, flow::Normalization::layernorm, flow::Normalization::rmsnorm,
          flow::Normalization::sphere};
}

namespace {
template <class T>
std::vector<T> random_values(std::size_t count, std::uint64_t seed, double lo, double hi) {
  const std::vector<double> v = uniform(count, seed, lo, hi);
  return std::vector<T>(v.begin(), v.end());
}
}  // namespace

template <class T>
flow::FlowLayer<T> random_layer(std::int64_t d, std::int64_t heads, std::uint64_t seed, bool extras,
                                double scale) {
  const double s = scale / std::sqrt(static_cast<double>(d));
  const auto h = static_cast<std::size_t>(heads), n = static_cast<std::size_t>(d);
  flow::FlowLayer<T> layer;
  layer.heads = heads;
  layer.relevance = random_values<T>(h * n * n, seed * 11 + 1, -s, s);
  layer.content = random_values<T>(h * n * n, seed * 11 + 2, -s, s);
  if (extras) {
    layer.key_bias = random_values<T>(h * n, seed * 11 + 3, -0.5, 0.5);
    layer.offset = random_values<T>(n, seed * 11 + 4, -0.2, 0.2);
    layer.norm_gain = random_values<T>(n, seed * 11 + 5, 0.5, 1.5);
    layer.norm_bias = random_values<T>(n, seed * 11 + 6, -0.2, 0.2);
  }
  return layer;
}

template <class T>
Tensor<T> clustered_clouds() {
  constexpr std::int64_t N = 33, d = 5;
  Tensor<T> clouds = flow::initial_clouds<T>(flow::InitialCloud::gaussian, 3, N, d, 21);
  auto token = [&](std::int64_t b, std::int64_t i) { return clouds.data() + (b * N + i) * d; };
  auto copy = [&](std::int64_t b, std::int64_t from, std::int64_t to, T scale) {
    for (std::int64_t a = 0; a < d; ++a) token(b, to)[a] = scale * token(b, from)[a];
  };
  for (std::int64_t to : {5, 17, 32}) copy(0, 0, to, T(1));
  for (std::int64_t to : {20, 21}) copy(0, 3, to, T(1));
  copy(0, 3, 31, T(2.5));
  for (std::int64_t i = 3; i < N; ++i) copy(1, i % 3, i, T(1));
  std::fill(token(1, 7), token(1, 7) + d, T(0));
  for (std::int64_t k = 0; k < N; ++k) {
    T* x = token(2, (k * 7) % N);
    std::fill(x, x + d, T(0));
    x[0] = static_cast<T>(std::cos(0.03 * static_cast<double>(k)));
    x[1] = static_cast<T>(std::sin(0.03 * static_cast<double>(k)));
  }
  return clouds;
}

Tensor<float> chain_and_groups() {
  constexpr std::int64_t N = 200, d = 3, chain = 150;
  Tensor<float> x0({1, N, d});
  for (std::int64_t k = 0; k < chain; ++k) {
    float* x = x0.data() + ((k * 37) % chain) * d;
    x[0] = static_cast<float>(std::cos(0.03 * static_cast<double>(k)));
    x[1] = static_cast<float>(std::sin(0.03 * static_cast<double>(k)));
    x[2] = 0.f;
  }
  for (std::int64_t i = chain; i < N; ++i) {
    const double phi = 1.2 * static_cast<double>((i - chain) % 5);
    float* x = x0.data() + i * d;
    x[0] = static_cast<float>(std::cos(phi));
    x[1] = static_cast<float>(std::sin(phi));
    x[2] = 1.f;
  }
  return x0;
}

flow::PhaseSettings phase_settings(std::int64_t tokens, std::int64_t dim, double beta_start,
                                   double beta_stop, std::int64_t beta_count, double time,
                                   double dt, std::int64_t clouds, std::uint64_t seed) {
  flow::PhaseSettings s;
  s.tokens = tokens;
  s.dim = dim;
  s.beta_start = beta_start;
  s.beta_stop = beta_stop;
  s.beta_count = beta_count;
  s.time = time;
  s.dt = dt;
  s.clouds = clouds;
  s.seed = seed;
  return s;
}

::testing::AssertionResult well_formed(const flow::PhaseDiagram& p, std::size_t times,
                                       std::size_t K) {
  if (p.times.size() != times || p.betas.size() != K || p.clustered.size() != times * K) {
    return ::testing::AssertionFailure()
           << "shape: " << p.times.size() << " times, " << p.betas.size() << " betas, "
           << p.clustered.size() << " values";
  }
  for (std::size_t e = 0; e < p.clustered.size(); ++e) {
    const double v = p.clustered[e];
    if (!(std::isfinite(v) && v >= 0.0 && v <= 1.0)) {
      return ::testing::AssertionFailure() << "clustered[" << e << "] = " << v;
    }
  }
  return ::testing::AssertionSuccess();
}

std::vector<Device> flow_devices() { return {Device::cpu, Device::cuda}; }

std::string device_name(const ::testing::TestParamInfo<Device>& info) {
  return to_string(info.param);
}

template flow::FlowLayer<float> random_layer<float>(std::int64_t, std::int64_t, std::uint64_t, bool,
                                                    double);
template flow::FlowLayer<double> random_layer<double>(std::int64_t, std::int64_t, std::uint64_t,
                                                      bool, double);
template Tensor<float> clustered_clouds<float>();
template Tensor<double> clustered_clouds<double>();

}  // namespace emflow::testing
