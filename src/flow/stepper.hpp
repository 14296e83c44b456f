// The flow written once (docs/MATH.md §4): the attention update of a batch (SA or USA, one
// attention call per run of clouds sharing beta, USA head by head, the offset, the tangent
// projection, the mean entropy), the Euler and RK4 steps, a layer of a stack, the recorded run
// and the generic phase sweep. All are templates over an operations type `Ops` that owns the
// memory and does the work:
//   HostOps   (host_ops.hpp): std::vector buffers, emflow::attend, OpenMP loops, observe();
//   DeviceOps (src/cuda/flow_ops.cpp): cuda::DeviceBuffer, one owned stream, the kernels of
//             kernels/flow_kernels.hpp, attention plans made once per configuration
//             (cuda::AttentionPlan, emflow/cuda.hpp) sharing one workspace sized once.
// Both make the same calls in the same order, so the two runs differ by rounding only.
//
// What Ops provides (T = Ops::Value; every pointer is memory of Ops' kind; counts in elements):
//   using Value, Buffer                       Buffer has data() and holds `count` elements
//   Buffer allocate(std::size_t count)
//   void reserve(in, out)                     before any attend: a call of these shapes will come
//   void ready()                              every reserve has been made
//   void attend(in, out)                      one attention call (AttentionInput / Output<T>)
//   void axpy(y, x, k, T step, n)             y = x + step k (y may be x)
//   void rk4_combine(x, k1, k2, k3, k4, T sixth, n)
//   void add(x, delta, n)                     x += delta
//   void normalize(norm, in, out, rows, dim, gain, bias)   out = N(in) (in may be out)
//   void tangent(cloud, update, rows, dim)    update_i -= <x_i, update_i> x_i
//   void usa_accumulate(update, delta, lse, log_tokens, first, rows, dim)
//   void add_offset(update, offset, rows, dim)
//   void mean_entropy(entropy, batch, heads, tokens, cloud_stride, head_stride, EntropySink)
//   EntropySink record(state, r, result)      record r of the state (trajectory, observables)
//   const T* to_host(state, std::vector<T>& scratch, n)    the state readable on the host
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "emflow/attention.hpp"
#include "emflow/flow.hpp"
#include "internal.hpp"

namespace emflow::flow::detail {

/// One layer's operators where Ops keeps them; absent optional parts are null.
template <class T>
struct LayerView {
  LayerOperators<T> ops;
  const T* gain = nullptr;  ///< layer / RMS norm gain (dim) or null
  const T* bias = nullptr;  ///< layer norm bias (dim) or null
};

/// Where the mean entropy of cloud b goes: at[b * stride], memory of Ops' kind; null: nowhere.
struct EntropySink {
  double* at = nullptr;
  std::int64_t stride = 1;
  explicit operator bool() const noexcept { return at != nullptr; }
};

/// What a Stepper evaluates and which scratch it needs.
struct StepperShape {
  std::int64_t batch = 0, tokens = 0, dim = 0;
  std::int64_t max_heads = 1;  ///< the most heads of any layer
  bool unnormalized = false;   ///< USA
  bool tangent = false;        ///< project the update on the tangent space of the sphere
  bool rk4 = false;            ///< room for the RK4 stages
  bool pre_norm = false;       ///< room for a normalised copy of the state
  /// The tokens of a whole cloud when the Stepper advances part of each (the rows of one
  /// process): USA divides by it. 0: `tokens`.
  std::int64_t cloud_tokens = 0;
};

template <class Ops>
class Stepper {
 public:
  using T = typename Ops::Value;
  using Buffer = typename Ops::Buffer;

  /// Allocates the scratch of every step and tells `ops` every attention call `layers` will
  /// need. betas: one per cloud, on the host.
  Stepper(Ops& ops, const std::vector<double>& betas, const StepperShape& shape,
          const std::vector<LayerView<T>>& layers)
      : ops_(ops), betas_(betas), shape_(shape) {
    const std::int64_t B = shape.batch, N = shape.tokens, d = shape.dim;
    const auto n = static_cast<std::size_t>(B * N * d);
    const auto count = [](bool needed, std::size_t c) { return needed ? c : std::size_t{0}; };
    update_ = ops.allocate(n);
    stage_ = ops.allocate(count(shape.rk4, n));
    k2_ = ops.allocate(count(shape.rk4, n));
    k3_ = ops.allocate(count(shape.rk4, n));
    k4_ = ops.allocate(count(shape.rk4, n));
    normed_ = ops.allocate(count(shape.pre_norm, n));
    head_delta_ = ops.allocate(count(shape.unnormalized, n));
    head_lse_ = ops.allocate(count(shape.unnormalized, static_cast<std::size_t>(B * N)));
    entropy_ = ops.allocate(static_cast<std::size_t>(B * N * shape.max_heads));
    for (std::int64_t b0 = 0; b0 < B; b0 = runs_.back().second) {
      runs_.emplace_back(b0, beta_run_end(betas, b0));
    }
    // Every call: each layer (one head at a time for USA), each run, with and without entropy.
    for (const LayerView<T>& layer : layers) {
      for (const auto& [b0, b1] : runs_) {
        for (bool with_entropy : {false, true}) {
          AttentionInput<T> in = input(nullptr, layer.ops, b0, b1);
          if (shape.unnormalized) in.layer.heads = 1;
          AttentionOutput<T> out;
          out.update = update_.data();
          out.lse = shape.unnormalized ? head_lse_.data() : nullptr;
          out.entropy = with_entropy ? entropy_.data() : nullptr;
          ops.reserve(in, out);
        }
      }
    }
    ops.ready();
  }

  /// The attention update of `cloud` into `out` (SA or USA, tangent-projected when asked), the
  /// mean entropy of each cloud into `sink` when given.
  void drift(const T* cloud, const LayerView<T>& layer, T* out, EntropySink sink) {
    const std::int64_t B = shape_.batch, N = shape_.tokens, d = shape_.dim, rows = B * N;
    const std::int64_t H = layer.ops.heads;
    T* const entropy = sink ? entropy_.data() : nullptr;
    if (!shape_.unnormalized) {
      // entropy: (B, H, N).
      attend_runs(cloud, layer.ops, out, nullptr, entropy);
      if (sink) ops_.mean_entropy(entropy_.data(), B, H, N, H * N, N, sink);
    } else {
      // USA: sum_j exp(s_ij) F x_j / N = delta_i Z_i / N, Z_i = exp(lse_i). Each head has its own
      // Z_i, so heads are evaluated one at a time; c is a constant drift, unscaled.
      // entropy: (H, B, N).
      const double log_tokens =
          std::log(static_cast<double>(shape_.cloud_tokens > 0 ? shape_.cloud_tokens : N));
      for (std::int64_t h = 0; h < H; ++h) {
        LayerOperators<T> head = layer.ops;
        head.heads = 1;
        head.relevance = layer.ops.relevance + h * d * d;
        head.content = layer.ops.content + h * d * d;
        head.key_bias = layer.ops.key_bias ? layer.ops.key_bias + h * d : nullptr;
        head.offset = nullptr;
        attend_runs(cloud, head, head_delta_.data(), head_lse_.data(),
                    entropy ? entropy + h * rows : nullptr);
        ops_.usa_accumulate(out, head_delta_.data(), head_lse_.data(), log_tokens, h == 0, rows, d);
      }
      if (layer.ops.offset) ops_.add_offset(out, layer.ops.offset, rows, d);
      if (sink) ops_.mean_entropy(entropy_.data(), B, H, N, N, rows, sink);
    }
    if (shape_.tangent) ops_.tangent(cloud, out, rows, d);
  }

  /// One continuous-time step of length h from `x`, in place; the mean entropy at the state
  /// before the step into `sink`.
  void continuous_step(T* x, const LayerView<T>& layer, Integrator integrator, double h,
                       EntropySink sink) {
    const std::int64_t n = elements();
    T* const k1 = update_.data();
    drift(x, layer, k1, sink);
    if (integrator == Integrator::euler) {
      ops_.axpy(x, x, k1, static_cast<T>(h), n);
    } else {
      ops_.axpy(stage_.data(), x, k1, static_cast<T>(h / 2), n);
      drift(stage_.data(), layer, k2_.data(), {});
      ops_.axpy(stage_.data(), x, k2_.data(), static_cast<T>(h / 2), n);
      drift(stage_.data(), layer, k3_.data(), {});
      ops_.axpy(stage_.data(), x, k3_.data(), static_cast<T>(h), n);
      drift(stage_.data(), layer, k4_.data(), {});
      ops_.rk4_combine(x, k1, k2_.data(), k3_.data(), k4_.data(), static_cast<T>(h / 6), n);
    }
    if (shape_.tangent)
      ops_.normalize(Normalization::sphere, x, x, rows(), shape_.dim, nullptr, nullptr);
  }

  /// One layer of a stack, in place: post-norm X <- N(X + Delta(X)) or pre-norm
  /// X <- X + Delta(N(X)); the mean entropy of the evaluated state into `sink`.
  void layer_step(T* x, const LayerView<T>& layer, Normalization norm, bool pre_norm,
                  EntropySink sink) {
    if (pre_norm) {
      ops_.normalize(norm, x, normed_.data(), rows(), shape_.dim, layer.gain, layer.bias);
      drift(normed_.data(), layer, update_.data(), sink);
      ops_.add(x, update_.data(), elements());
    } else {
      drift(x, layer, update_.data(), sink);
      ops_.add(x, update_.data(), elements());
      ops_.normalize(norm, x, x, rows(), shape_.dim, layer.gain, layer.bias);
    }
  }

  /// The mean entropy of the state `x` under `layer` (normalised first for a pre-norm stack).
  void final_entropy(const T* x, const LayerView<T>& layer, Normalization norm, bool pre_norm,
                     EntropySink sink) {
    const T* at = x;
    if (pre_norm) {
      ops_.normalize(norm, x, normed_.data(), rows(), shape_.dim, layer.gain, layer.bias);
      at = normed_.data();
    }
    drift(at, layer, update_.data(), sink);
  }

 private:
  std::int64_t rows() const noexcept { return shape_.batch * shape_.tokens; }
  std::int64_t elements() const noexcept { return rows() * shape_.dim; }

  AttentionInput<T> input(const T* cloud, const LayerOperators<T>& layer, std::int64_t b0,
                          std::int64_t b1) const {
    AttentionInput<T> in;
    in.cloud = cloud ? cloud + b0 * shape_.tokens * shape_.dim : nullptr;
    in.batch = b1 - b0;
    in.tokens = shape_.tokens;
    in.dim = shape_.dim;
    in.layer = layer;
    in.beta = betas_[static_cast<std::size_t>(b0)];
    return in;
  }

  // One attention call on each run [b0, b1) of consecutive clouds with one beta; lse and
  // entropy may be null.
  void attend_runs(const T* cloud, const LayerOperators<T>& layer, T* delta, T* lse, T* entropy) {
    const std::int64_t N = shape_.tokens, H = layer.heads;
    for (const auto& [b0, b1] : runs_) {
      AttentionOutput<T> out;
      out.update = delta + b0 * N * shape_.dim;
      out.lse = lse ? lse + b0 * H * N : nullptr;
      out.entropy = entropy ? entropy + b0 * H * N : nullptr;
      ops_.attend(input(cloud, layer, b0, b1), out);
    }
  }

  Ops& ops_;
  const std::vector<double>& betas_;
  StepperShape shape_;
  std::vector<std::pair<std::int64_t, std::int64_t>> runs_;
  Buffer update_, stage_, k2_, k3_, k4_, normed_, head_delta_, head_lse_, entropy_;
};

/// The recorded run of run_flow from the validated state `x` (B, N, d), in place, into
/// `result` (allocate_result): records every k steps and the last, each with the mean entropy
/// of the evaluation at that state (the last layer's operators for the final state of a stack).
/// cloud_tokens: StepperShape::cloud_tokens (the state holds part of every cloud), or 0.
template <class Ops>
void run_recorded(Ops& ops, typename Ops::Value* x,
                  const std::vector<LayerView<typename Ops::Value>>& layers,
                  const std::vector<double>& betas, const FlowSettings& settings,
                  FlowResult<typename Ops::Value>& result, const Progress& progress,
                  std::int64_t cloud_tokens = 0) {
  const Shape& shape = result.trajectory.shape();
  const bool continuous = settings.layers == 0;
  StepperShape s;
  s.batch = shape[1];
  s.tokens = shape[2];
  s.dim = shape[3];
  for (const auto& layer : layers) s.max_heads = std::max(s.max_heads, layer.ops.heads);
  s.unnormalized = settings.unnormalized;
  s.tangent = continuous && settings.norm == Normalization::sphere;
  s.rk4 = continuous && settings.integrator == Integrator::rk4;
  s.pre_norm = !continuous && settings.pre_norm;
  s.cloud_tokens = cloud_tokens;
  Stepper<Ops> stepper(ops, betas, s, layers);
  const auto layer_of = [&](std::int64_t step) -> const auto& {
    return layers[layers.size() == 1 ? 0 : static_cast<std::size_t>(step)];
  };

  if (s.tangent) {
    ops.normalize(Normalization::sphere, x, x, s.batch * s.tokens, s.dim, nullptr, nullptr);
  }
  const std::int64_t S = step_count(settings), every = settings.record_every;
  double t = 0.0;
  std::int64_t r = 0;
  for (std::int64_t step = 0;; ++step) {
    const bool record = step % every == 0 || step == S;
    EntropySink sink;
    if (record) {
      result.times[static_cast<std::size_t>(r)] = continuous ? t : static_cast<double>(step);
      result.steps[static_cast<std::size_t>(r)] = step;
      sink = ops.record(x, r, result);
    }
    if (step == S) {
      // The entropy of the final state: one more evaluation (the last layer's operators).
      stepper.final_entropy(x, layer_of(continuous ? 0 : S - 1), settings.norm, s.pre_norm, sink);
      break;
    }
    if (continuous) {
      const double h = step_length(settings.time, settings.dt, S, step);
      stepper.continuous_step(x, layers[0], settings.integrator, h, sink);
      t += h;
    } else {
      stepper.layer_step(x, layer_of(step), settings.norm, settings.pre_norm, sink);
    }
    if (record) ++r;
    if (progress) progress(step + 1, S);
  }
}

/// The generic phase sweep from the state `x` (problem.clouds where Ops keeps it), in place:
/// RK4 on the sphere with `identity` (M = F = I), the clustered fractions counted on the host
/// before every step and after the last. Returns the diagram (S + 1, K).
template <class Ops>
std::vector<double> phase_stepped(Ops& ops, float* x, const LayerView<float>& identity,
                                  const PhaseProblem& p, const Progress& progress) {
  StepperShape s;
  s.batch = p.batch;
  s.tokens = p.tokens;
  s.dim = p.dim;
  s.tangent = true;
  s.rk4 = true;
  Stepper<Ops> stepper(ops, p.betas, s, {identity});
  std::vector<double> clustered(static_cast<std::size_t>((p.steps + 1) * p.beta_count));
  std::vector<float> host;
  const std::int64_t n = p.batch * p.tokens * p.dim;
  for (std::int64_t step = 0;; ++step) {
    count_clustered(p, ops.to_host(x, host, n), clustered.data() + step * p.beta_count);
    if (step == p.steps) break;
    stepper.continuous_step(x, identity, Integrator::rk4, step_length(p.time, p.dt, p.steps, step),
                            {});
    if (progress) progress(step + 1, p.steps);
  }
  return clustered;
}

}  // namespace emflow::flow::detail
