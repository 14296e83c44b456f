// The phase diagram of Geshkovski, Letrouit, Polyanskiy and Rigollet: the fraction of clustered
// pairs over (time, beta) for Q = K = V = I on the sphere. The generic path runs every step
// through the flow's attention update (stepper.hpp, on the host or in device memory); the
// specialised paths integrate the same equations, on the CPU in sphere_kernel.cpp and on a CUDA
// device in kernels/phase_kernels.cu.
#include <algorithm>
#include <cmath>
#include <iterator>
#include <string>
#include <utility>

#include "core/check.hpp"
#include "core/memory.hpp"
#include "emflow/attention.hpp"
#include "emflow/capability.hpp"
#include "emflow/flow.hpp"
#include "internal.hpp"

#if EMFLOW_WITH_CUDA
#include "kernels/phase_kernels.hpp"
#endif

namespace emflow::flow {

using emflow::detail::fail;
using emflow::detail::fail_argument;

namespace {

/// The factor of the sweep's size to name when it is too large: the largest of them.
const char* largest_factor(const PhaseSettings& s) {
  const std::pair<const char*, std::int64_t> factors[] = {
      {"clouds", s.clouds}, {"betas", s.beta_count}, {"tokens", s.tokens}, {"dim", s.dim}};
  const auto* largest =
      std::max_element(std::begin(factors), std::end(factors),
                       [](const auto& a, const auto& b) { return a.second < b.second; });
  return largest->first;
}

/// "clouds 2048 x betas 90 x tokens 32 x dim 2"
std::string sweep_size(const PhaseSettings& s) {
  return emflow::detail::concat("clouds ", s.clouds, " x betas ", s.beta_count, " x tokens ",
                                s.tokens, " x dim ", s.dim);
}

}  // namespace

void validate(const PhaseSettings& s) {
  const char* op = "phase";
  if (s.tokens < 2) fail_argument(op, "tokens", "must be >= 2, got ", s.tokens);
  emflow::detail::expect_positive(op, "dim", s.dim);
  emflow::detail::expect_positive(op, "clouds", s.clouds);
  emflow::detail::expect_positive(op, "betas", s.beta_count);
  if (!(std::isfinite(s.beta_start) && s.beta_start > 0.0)) {
    fail_argument(op, "betas", "start must be finite and > 0, got ", s.beta_start);
  }
  if (!(std::isfinite(s.beta_stop) && s.beta_stop >= s.beta_start)) {
    fail_argument(op, "betas", "stop must be finite and >= start (", s.beta_start, "), got ",
                  s.beta_stop);
  }
  if (!(std::isfinite(s.time) && s.time > 0.0)) {
    fail_argument(op, "time", "must be finite and > 0, got ", s.time);
  }
  if (!(std::isfinite(s.dt) && s.dt > 0.0)) {
    fail_argument(op, "dt", "must be finite and > 0, got ", s.dt);
  }
  if (s.time / s.dt > 1e7) fail_argument(op, "dt", "gives more than 1e7 steps");
  if (!(s.cluster_eps > 0.0 && s.cluster_eps < 2.0)) {
    fail_argument(op, "cluster_eps", "must be in (0, 2), got ", s.cluster_eps);
  }
  // The sweep holds C * K clouds at once: refused, naming the largest factor, beyond 2^31 values.
  std::int64_t values = 1;
  bool overflow = false;
  for (std::int64_t factor : {s.clouds, s.beta_count, s.tokens, s.dim}) {
    overflow = overflow || __builtin_mul_overflow(values, factor, &values);
  }
  if (overflow || values > (std::int64_t{1} << 31)) {
    fail_argument(op, largest_factor(s), "is too large: ", sweep_size(s), " = ",
                  overflow ? std::string("more than 2^63") : std::to_string(values),
                  " values of the sweep's clouds, more than the limit of 2^31");
  }
}

namespace detail {

void expect_sweep_fits(const PhaseSettings& s, std::int64_t bytes, const char* what) {
  const std::int64_t limit = emflow::detail::memory_limit_bytes();
  if (bytes > limit) {
    fail(ErrorCode::out_of_memory, "phase: argument '", largest_factor(s), "' is too large: ", what,
         " of ", sweep_size(s), " need ", bytes, " bytes, more than the ", limit,
         " bytes of memory available");
  }
}

}  // namespace detail

namespace {

std::vector<double> beta_grid(const PhaseSettings& s) {
  std::vector<double> betas(static_cast<std::size_t>(s.beta_count));
  for (std::int64_t k = 0; k < s.beta_count; ++k) {
    betas[static_cast<std::size_t>(k)] =
        s.beta_count == 1 ? s.beta_start
                          : s.beta_start + (s.beta_stop - s.beta_start) * static_cast<double>(k) /
                                               static_cast<double>(s.beta_count - 1);
  }
  return betas;
}

std::vector<double> time_grid(const PhaseSettings& s, std::int64_t steps) {
  std::vector<double> times(static_cast<std::size_t>(steps + 1));
  double t = 0.0;
  for (std::int64_t k = 0; k <= steps; ++k) {
    times[static_cast<std::size_t>(k)] = t;
    if (k < steps) t += detail::step_length(s.time, s.dt, steps, k);
  }
  return times;
}

}  // namespace

namespace detail {

void count_clustered(const PhaseProblem& p, const float* clouds, double* row) {
  const std::int64_t C = p.clouds_per_beta, N = p.tokens, d = p.dim;
  const double pairs = 0.5 * static_cast<double>(N) * static_cast<double>(N - 1);
#pragma omp parallel for schedule(static)
  for (std::int64_t k = 0; k < p.beta_count; ++k) {
    double sum = 0.0;
    for (std::int64_t c = 0; c < C; ++c) {
      const float* x = clouds + (k * C + c) * N * d;
      std::int64_t clustered = 0;
      for (std::int64_t i = 0; i < N; ++i) {
        for (std::int64_t j = i + 1; j < N; ++j) {
          double inner = 0.0;
          for (std::int64_t a = 0; a < d; ++a)
            inner += static_cast<double>(x[i * d + a]) * x[j * d + a];
          clustered += inner > p.threshold;
        }
      }
      sum += static_cast<double>(clustered) / pairs;
    }
    row[k] = sum / static_cast<double>(C);
  }
}

}  // namespace detail

PhaseDiagram phase_diagram_generic(const PhaseSettings& s, const ExecutionOptions& options,
                                   const Progress& progress) {
  validate(s);
  check_threads(options.threads, "phase");
  const std::int64_t C = s.clouds, K = s.beta_count, N = s.tokens, d = s.dim;
  // The batch of every cloud of every beta, the stepper's RK4 stages and the update: about 7
  // copies (validate keeps C K N d below 2^31).
  detail::expect_sweep_fits(s, 7 * K * C * N * d * static_cast<std::int64_t>(sizeof(float)),
                            "the clouds and the integration state");
  // A failed allocation below is reported as ErrorCode::out_of_memory.
  return emflow::detail::reporting_out_of_memory("phase", "", [&] {
    PhaseDiagram out;
    out.betas = beta_grid(s);
    detail::PhaseProblem p;
    p.batch = K * C;
    p.tokens = N;
    p.dim = d;
    p.clouds_per_beta = C;
    p.beta_count = K;
    p.steps = detail::continuous_steps(s.time, s.dt);
    p.time = s.time;
    p.dt = s.dt;
    p.threshold = 1.0 - s.cluster_eps;
    out.times = time_grid(s, p.steps);

    // All C * K clouds in one batch, sorted by beta so each step is one attend call per beta.
    const Tensor<float> initial = initial_clouds<float>(InitialCloud::sphere, C, N, d, s.seed);
    p.clouds.resize(static_cast<std::size_t>(K * C * N * d));
    p.betas.resize(static_cast<std::size_t>(K * C));
    for (std::int64_t k = 0; k < K; ++k) {
      std::copy(initial.values().begin(), initial.values().end(),
                p.clouds.begin() + static_cast<std::ptrdiff_t>(k * C * N * d));
      std::fill(p.betas.begin() + k * C, p.betas.begin() + (k + 1) * C,
                out.betas[static_cast<std::size_t>(k)]);
    }
    // Every step is the attention of one beta's C clouds: the sweep runs where route() sends it.
    Problem attention;
    attention.batch = C;
    attention.tokens = attention.query_tokens = N;
    attention.dim = d;
    ExecutionOptions where = options;
    where.device = require_route(attention, options.device, "phase").device;
#if EMFLOW_WITH_CUDA
    if (where.device == Device::cuda) {
      out.clustered = detail::phase_generic_device(p, progress);
      return out;
    }
#endif
    out.clustered = detail::phase_generic_host(p, where, progress);
    return out;
  });
}

std::vector<std::int64_t> phase_counts(const PhaseSettings& s, std::int64_t first,
                                       std::int64_t last, const ExecutionOptions& options,
                                       const Progress& progress) {
  validate(s);
  check_threads(options.threads, "phase");
  if (options.device != Device::cpu && options.device != Device::automatic) {
    fail_argument("phase", "device", "counts run on the CPU path (cpu), got ",
                  to_string(options.device));
  }
  if (first < 0 || last < first || last > s.clouds * s.beta_count) {
    fail_argument("phase", "pairs", "[", first, ", ", last, ") is not within [0, ",
                  s.clouds * s.beta_count, ")");
  }
  detail::expect_sweep_fits(s,
                            s.clouds * s.tokens * s.dim * static_cast<std::int64_t>(sizeof(float)) +
                                detail::phase_kernel_bytes(s.tokens, s.dim, options.threads),
                            "the clouds and every thread's integration state");
  return emflow::detail::reporting_out_of_memory("phase", "", [&] {
    const Tensor<float> initial =
        initial_clouds<float>(InitialCloud::sphere, s.clouds, s.tokens, s.dim, s.seed);
    return detail::phase_counts_kernel(initial.values(), s.clouds, s.tokens, s.dim, beta_grid(s),
                                       s.time, s.dt, s.cluster_eps, options.threads, progress,
                                       first, last);
  });
}

PhaseDiagram phase_from_counts(const PhaseSettings& s, const std::vector<std::int64_t>& counts) {
  validate(s);
  const std::int64_t steps = detail::continuous_steps(s.time, s.dt);
  if (static_cast<std::int64_t>(counts.size()) != (steps + 1) * s.beta_count) {
    fail_argument("phase", "counts", "has ", counts.size(), " entries, expected ",
                  (steps + 1) * s.beta_count, " (steps + 1 times betas)");
  }
  PhaseDiagram out;
  out.betas = beta_grid(s);
  out.times = time_grid(s, steps);
  out.clustered = detail::phase_fractions(counts, s.clouds, s.tokens);
  return out;
}

PhaseDiagram phase_diagram(const PhaseSettings& s, const ExecutionOptions& options,
                           const Progress& progress) {
  validate(s);
  check_threads(options.threads, "phase");
  if (options.device == Device::reference || s.generic) {
    return phase_diagram_generic(s, options, progress);
  }
  // Device::cuda throws when no device can be used; Device::automatic takes the GPU when there
  // is one, else the CPU.
  const Device device = resolve_device(options.device);
#if EMFLOW_WITH_CUDA
  // A cloud larger than one block (more than 1024 tokens, or its state beyond the block's
  // shared memory) takes the generic path in device memory, one call per beta and RK4 stage.
  if (device == Device::cuda && !detail::phase_kernel_cuda_fits(s.tokens, s.dim)) {
    ExecutionOptions on_device = options;
    on_device.device = Device::cuda;
    return phase_diagram_generic(s, on_device, progress);
  }
#else
  (void)device;  // without CUDA, Device::cuda has thrown and automatic is the CPU
#endif
  const std::int64_t clouds_bytes =
      s.clouds * s.tokens * s.dim * static_cast<std::int64_t>(sizeof(float));
  detail::expect_sweep_fits(
      s,
      device == Device::cuda
          ? clouds_bytes
          : clouds_bytes + detail::phase_kernel_bytes(s.tokens, s.dim, options.threads),
      "the clouds and every thread's integration state");
  return emflow::detail::reporting_out_of_memory("phase", "", [&] {
    const std::int64_t steps = detail::continuous_steps(s.time, s.dt);
    PhaseDiagram out;
    out.betas = beta_grid(s);
    out.times = time_grid(s, steps);
    const Tensor<float> initial =
        initial_clouds<float>(InitialCloud::sphere, s.clouds, s.tokens, s.dim, s.seed);
#if EMFLOW_WITH_CUDA
    if (device == Device::cuda) {
      out.clustered = detail::phase_kernel_cuda(
          initial.values(), s.clouds, s.tokens, s.dim, out.betas, steps,
          detail::step_length(s.time, s.dt, steps, 0),
          detail::step_length(s.time, s.dt, steps, steps - 1), s.cluster_eps, progress);
      return out;
    }
#endif
    out.clustered = detail::phase_kernel(initial.values(), s.clouds, s.tokens, s.dim, out.betas,
                                         s.time, s.dt, s.cluster_eps, options.threads, progress);
    return out;
  });
}

}  // namespace emflow::flow
