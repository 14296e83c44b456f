// run_flow: the validation of its arguments, the shape of its result, and where it runs: on the
// host (host_ops.cpp) or, when route() sends its attention to a CUDA device, in device memory
// (src/cuda/flow_ops.cpp), both the recorded run of stepper.hpp.
#include <algorithm>
#include <cmath>

#include "core/check.hpp"
#include "emflow/capability.hpp"
#include "emflow/flow.hpp"
#include "internal.hpp"

namespace emflow::flow {

using emflow::detail::fail_argument;

namespace detail {

std::int64_t continuous_steps(double time, double dt) noexcept {
  // The small slack keeps T = 30, dt = 0.1 at 300 steps despite 30 / 0.1 rounding above 300.
  return std::max<std::int64_t>(1, static_cast<std::int64_t>(std::ceil(time / dt - 1e-9)));
}

double step_length(double time, double dt, std::int64_t steps, std::int64_t s) noexcept {
  return s + 1 < steps ? dt : time - dt * static_cast<double>(steps - 1);
}

}  // namespace detail

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
std::vector<double> validate_flow(const Shape& initial, const std::vector<double>& betas_in,
                                  const std::vector<FlowLayer<T>>& layers,
                                  const FlowSettings& settings) {
  const char* op = "run_flow";
  if (initial.size() != 3) {
    fail_argument(op, "initial", "must have shape (batch, tokens, dim), got ",
                  emflow::to_string(initial));
  }
  const std::int64_t B = initial[0], N = initial[1], d = initial[2];
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
    if (settings.time / settings.dt > static_cast<double>(kMaxSteps)) {
      fail_argument(op, "dt", "gives more than ", kMaxSteps, " steps (time ", settings.time,
                    ", dt ", settings.dt, ")");
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
  if (!(std::isfinite(settings.norm_eps) && settings.norm_eps > 0.0)) {
    fail_argument(op, "norm_eps", "must be finite and > 0, got ", settings.norm_eps);
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
  const std::vector<double> betas =
      detail::validate_flow(initial.shape(), betas_in, layers, settings);
  check_threads(options.threads, "run_flow");
  // Where the run's attention evaluations run (route(), capability.hpp, for the largest of
  // them): the whole run goes there. Throws ErrorCode::unsupported, with the reason, when cuda is
  // asked for but unusable.
  Problem attention;
  attention.storage = dtype_of<T>();
  attention.batch = initial.extent(0);
  attention.tokens = attention.query_tokens = initial.extent(1);
  attention.dim = initial.extent(2);
  for (const FlowLayer<T>& layer : layers) {
    attention.heads = std::max(attention.heads, layer.heads);
    attention.key_bias = attention.key_bias || !layer.key_bias.empty();
    attention.offset = attention.offset || !layer.offset.empty();
  }
  attention.lse = attention.entropy = true;
  const Device device = require_route(attention, options.device, "run_flow").device;
  const bool has_eps =
      settings.norm == Normalization::layernorm || settings.norm == Normalization::rmsnorm;
  const bool builtin_eps = !has_eps || settings.norm_eps == 1e-5;
  if (device == Device::cuda) {
    // The GPU's layer norm kernel has eps 1e-5 built in: another eps runs on the host when the
    // device was left to choose, and is refused when the GPU was asked for.
    if (!builtin_eps && options.device == Device::cuda) {
      emflow::detail::fail(
          ErrorCode::unsupported, "run_flow: norm_eps ", settings.norm_eps,
          " on the CUDA device: its layer norm kernel has eps 1e-5 built in (run on the CPU)");
    }
#if EMFLOW_WITH_CUDA
    // The whole run stays on the device: attention, steps and observables.
    if (builtin_eps) return detail::run_flow_device(initial, betas, layers, settings, progress);
#endif
    ExecutionOptions host = options;
    host.device = Device::cpu;
    return detail::run_flow_host(initial, betas, layers, settings, host, progress);
  }
  ExecutionOptions host = options;
  host.device = device;  // every evaluation where the run's route says, cpu or reference
  return detail::run_flow_host(initial, betas, layers, settings, host, progress);
}

#define EMFLOW_RUN_FLOW_INSTANTIATE(T)                                                            \
  template FlowResult<T> run_flow<T>(const Tensor<T>&, const std::vector<double>&,                \
                                     const std::vector<FlowLayer<T>>&, const FlowSettings&,       \
                                     const ExecutionOptions&, const Progress&);                   \
  template std::vector<double> detail::validate_flow<T>(const Shape&, const std::vector<double>&, \
                                                        const std::vector<FlowLayer<T>>&,         \
                                                        const FlowSettings&);                     \
  template FlowResult<T> detail::allocate_result<T>(std::int64_t, std::int64_t, std::int64_t,     \
                                                    const FlowSettings&);

EMFLOW_RUN_FLOW_INSTANTIATE(float)
EMFLOW_RUN_FLOW_INSTANTIATE(double)
#undef EMFLOW_RUN_FLOW_INSTANTIATE

}  // namespace emflow::flow
