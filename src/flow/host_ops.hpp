// The operations of stepper.hpp on the host (std::vector buffers, every attention evaluation an
// emflow::attend call on cpu or reference, the element-wise parts OpenMP loops, the observables
// of a record computed by observe() in double). A header so that a run whose attention or
// records go elsewhere (the flow across processes, src/distributed) can replace those
// operations and keep the rest.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/parallel.hpp"
#include "emflow/flow.hpp"
#include "stepper.hpp"

namespace emflow::flow::detail {

template <class T>
LayerView<T> host_view(const FlowLayer<T>& layer) {
  LayerView<T> view;
  view.ops = layer.operators();
  view.gain = layer.norm_gain.empty() ? nullptr : layer.norm_gain.data();
  view.bias = layer.norm_bias.empty() ? nullptr : layer.norm_bias.data();
  return view;
}

template <class T>
class HostOps {
 public:
  using Value = T;
  using Buffer = std::vector<T>;

  explicit HostOps(const ExecutionOptions& options, double norm_eps = 1e-5)
      : options_(options), norm_eps_(norm_eps) {}

  /// Records go to `result`, with the observables of each cloud at its beta; the entropies are
  /// kept apart until finish().
  void record_into(const std::vector<double>& betas, double cluster_eps, std::size_t records) {
    betas_ = &betas;
    cluster_eps_ = cluster_eps;
    entropies_.assign(records * betas.size(), 0.0);
  }

  Buffer allocate(std::size_t count) { return Buffer(count); }
  void reserve(const AttentionInput<T>&, const AttentionOutput<T>&) {}
  void ready() {}

  void attend(const AttentionInput<T>& in, const AttentionOutput<T>& requested) {
    // The CPU backends compute lse and entropy in any case: asking for them always keeps every
    // call on one path.
    AttentionOutput<T> out = requested;
    const auto stats = static_cast<std::size_t>(in.batch * in.layer.heads * in.tokens);
    if (out.lse == nullptr) out.lse = scratch(lse_, stats);
    if (out.entropy == nullptr) out.entropy = scratch(entropy_, stats);
    // A small call runs attend on one thread. A flow makes 4 attend calls per RK4 step, and each
    // call's OpenMP team costs a fork and a join whose spinning threads stall as soon as another
    // process holds a core: measured for N = d = 128 on the 2-core machine while it compiled,
    // 150 RK4 steps took 1 to 7 s with 2 threads and 0.3 s with one. Below about 4M N^2 d units
    // (16 MFLOP, a millisecond on one core) the second core gains too little to risk that. The
    // results do not depend on the number of threads.
    ExecutionOptions run = options_;
    if (run.threads == 0 &&
        in.batch * in.layer.heads * in.tokens * in.tokens * in.dim < (std::int64_t{1} << 22)) {
      run.threads = 1;
    }
    emflow::attend(in, out, run);
  }

  void axpy(T* y, const T* x, const T* k, T step, std::int64_t n) {
#pragma omp parallel for schedule(static) if (n > 65536)
    for (std::int64_t e = 0; e < n; ++e) y[e] = x[e] + step * k[e];
  }

  void rk4_combine(T* x, const T* k1, const T* k2, const T* k3, const T* k4, T sixth,
                   std::int64_t n) {
#pragma omp parallel for schedule(static) if (n > 65536)
    for (std::int64_t e = 0; e < n; ++e) x[e] += sixth * (k1[e] + T(2) * (k2[e] + k3[e]) + k4[e]);
  }

  void add(T* x, const T* delta, std::int64_t n) {
#pragma omp parallel for schedule(static) if (n > 65536)
    for (std::int64_t e = 0; e < n; ++e) x[e] += delta[e];
  }

  void normalize(Normalization norm, const T* in, T* out, std::int64_t rows, std::int64_t dim,
                 const T* gain, const T* bias) {
    if (in != out) std::copy(in, in + rows * dim, out);
    flow::normalize(norm, out, rows, dim, gain, bias, norm_eps_);
  }

  // P_x y = y - <x, y> x: the part of the update that moves along the sphere.
  void tangent(const T* cloud, T* update, std::int64_t rows, std::int64_t d) {
#pragma omp parallel for schedule(static) if (rows * d > 32768)
    for (std::int64_t r = 0; r < rows; ++r) {
      const T* x = cloud + r * d;
      T* y = update + r * d;
      double dot = 0.0;
      for (std::int64_t a = 0; a < d; ++a) dot += static_cast<double>(x[a]) * y[a];
      for (std::int64_t a = 0; a < d; ++a) y[a] = static_cast<T>(y[a] - dot * x[a]);
    }
  }

  void usa_accumulate(T* update, const T* delta, const T* lse, double log_tokens, bool first,
                      std::int64_t rows, std::int64_t d) {
#pragma omp parallel for schedule(static) if (rows * d > 32768)
    for (std::int64_t r = 0; r < rows; ++r) {
      const double scale = std::exp(static_cast<double>(lse[r]) - log_tokens);
      for (std::int64_t a = 0; a < d; ++a) {
        const T term = static_cast<T>(scale * static_cast<double>(delta[r * d + a]));
        update[r * d + a] = (first ? T(0) : update[r * d + a]) + term;
      }
    }
  }

  void add_offset(T* update, const T* offset, std::int64_t rows, std::int64_t d) {
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t a = 0; a < d; ++a) update[r * d + a] += offset[a];
  }

  // Head by head, token by token: a fixed order.
  void mean_entropy(const T* entropy, std::int64_t batch, std::int64_t heads, std::int64_t tokens,
                    std::int64_t cloud_stride, std::int64_t head_stride, EntropySink sink) {
    for (std::int64_t b = 0; b < batch; ++b) {
      double sum = 0.0;
      for (std::int64_t h = 0; h < heads; ++h) {
        const T* e = entropy + h * head_stride + b * cloud_stride;
        for (std::int64_t i = 0; i < tokens; ++i) sum += static_cast<double>(e[i]);
      }
      sink.at[b * sink.stride] = sum / static_cast<double>(heads * tokens);
    }
  }

  EntropySink record(const T* x, std::int64_t r, FlowResult<T>& result) {
    const Shape& shape = result.trajectory.shape();
    const std::int64_t B = shape[1], N = shape[2], d = shape[3];
    std::copy(x, x + B * N * d, result.trajectory.data() + r * B * N * d);
    ::emflow::detail::ParallelErrors errors;  // observe() allocates
#pragma omp parallel for schedule(dynamic) if (B > 1 && B * N * N * d > (1 << 16))
    for (std::int64_t b = 0; b < B; ++b) {
      errors.run([&] {
        result.observables[static_cast<std::size_t>(r * B + b)] =
            observe(x + b * N * d, N, d, (*betas_)[static_cast<std::size_t>(b)], cluster_eps_);
      });
    }
    errors.rethrow();
    return {entropies_.data() + r * B, 1};
  }

  /// The recorded entropies into the result.
  void finish(FlowResult<T>& result) const {
    for (std::size_t e = 0; e < result.observables.size(); ++e) {
      result.observables[e].entropy = entropies_[e];
    }
  }

  const T* to_host(const T* x, std::vector<T>&, std::int64_t) const { return x; }

 protected:
  static T* scratch(std::vector<T>& buffer, std::size_t size) {
    if (buffer.size() < size) buffer.resize(size);
    return buffer.data();
  }

  ExecutionOptions options_;
  double norm_eps_ = 1e-5;
  std::vector<T> lse_, entropy_;
  const std::vector<double>* betas_ = nullptr;
  double cluster_eps_ = 0.0;
  std::vector<double> entropies_;
};

}  // namespace emflow::flow::detail
