// The device-resident run_flow (flow_cuda.hpp): host orchestration of one run on one owned
// stream. The state, the RK4 stages, the update, the layers' operators, the attention
// workspace and the observables live in device memory from the first step to the last; the
// host enqueues work and never waits for it except where it needs data (see record below).
#include "flow_cuda.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "attention_kernels.hpp"
#include "core/check.hpp"
#include "cuda_support.hpp"
#include "emflow/cuda.hpp"
#include "flow/internal.hpp"

namespace emflow::flow::detail {

namespace {

using emflow::detail::check_cuda;
using emflow::detail::fail;

constexpr const char* kOperation = "run_flow";

// One layer's operators in one device allocation; absent optional parts are null pointers.
template <class T>
struct DeviceLayer {
  cuda::DeviceBuffer<T> storage;
  LayerOperators<T> ops;
  const T* gain = nullptr;
  const T* bias = nullptr;
};

template <class T>
DeviceLayer<T> upload_layer(const FlowLayer<T>& layer, cudaStream_t stream) {
  const std::vector<T>* parts[] = {&layer.relevance, &layer.content,   &layer.key_bias,
                                   &layer.offset,    &layer.norm_gain, &layer.norm_bias};
  std::vector<T> packed;
  for (const std::vector<T>* part : parts) packed.insert(packed.end(), part->begin(), part->end());
  DeviceLayer<T> device;
  device.storage = cuda::DeviceBuffer<T>(packed.size());
  // Pageable source: the copy returns once it is staged, so `packed` may go out of scope.
  device.storage.copy_from_host(packed.data(), packed.size(), stream);
  const T* cursor = device.storage.data();
  const T* at[6];
  for (std::size_t p = 0; p < 6; ++p) {
    at[p] = parts[p]->empty() ? nullptr : cursor;
    cursor += parts[p]->size();
  }
  device.ops.heads = layer.heads;
  device.ops.relevance = at[0];
  device.ops.content = at[1];
  device.ops.key_bias = at[2];
  device.ops.offset = at[3];
  device.gain = at[4];
  device.bias = at[5];
  return device;
}

// The kernels and launches index with int: refuse what does not fit before allocating.
void check_fits_int(std::int64_t value, const char* what) {
  if (value > INT_MAX) {
    fail(ErrorCode::unsupported, kOperation, ": ", what, " = ", value,
         " exceeds the CUDA flow's limit of ", INT_MAX);
  }
}

}  // namespace

template <class T>
FlowResult<T> run_flow_cuda(const Tensor<T>& initial, const std::vector<double>& betas,
                            const std::vector<FlowLayer<T>>& layers, const FlowSettings& settings,
                            const Progress& progress) {
  using emflow::detail::checked_multiply;
  const std::int64_t B = initial.extent(0), N = initial.extent(1), d = initial.extent(2);
  const bool continuous = settings.layers == 0;
  const bool sphere = settings.norm == Normalization::sphere;
  const bool tangent = continuous && sphere;
  const bool usa = settings.unnormalized;
  const bool rk4 = continuous && settings.integrator == Integrator::rk4;
  const std::int64_t S = step_count(settings), every = settings.record_every;
  const std::int64_t R = record_count(S, every);

  // Shapes first, allocations after.
  std::int64_t max_heads = 1;
  for (const FlowLayer<T>& layer : layers) max_heads = std::max(max_heads, layer.heads);
  const std::int64_t elements =
      checked_multiply(kOperation, "initial", checked_multiply(kOperation, "initial", B, N), d);
  check_fits_int(elements, "batch * tokens * dim");
  check_fits_int(checked_multiply(kOperation, "layers", B * N, max_heads),
                 "batch * tokens * heads");
  const ObserveScratchSizes scratch_sizes = observe_scratch_sizes(B, N);
  check_fits_int(scratch_sizes.rows, "batch * tokens * 5 (observables)");
  check_fits_int(scratch_sizes.edges, "batch * tokens * ceil(tokens / 32) (clustered pairs)");
  const int n = static_cast<int>(elements), rows = static_cast<int>(B * N);
  const int tokens = static_cast<int>(N), dim = static_cast<int>(d), batch = static_cast<int>(B);

  FlowResult<T> result = allocate_result<T>(B, N, d, settings);

  // Launch failures are read back with cudaGetLastError: an error the caller left pending is
  // reported as such before anything is enqueued.
  emflow::detail::check_no_pending_error(kOperation);
  // The stream is declared first so it outlives every buffer: on an error path the buffers are
  // freed (cudaFree waits for the device) before the stream is destroyed.
  const emflow::detail::OwnedStream owned(kOperation);
  const cudaStream_t stream = owned.get();

  const auto count = [](std::int64_t c) { return static_cast<std::size_t>(c); };
  cuda::DeviceBuffer<T> state(count(elements)), update(count(elements));
  cuda::DeviceBuffer<T> stage(rk4 ? count(elements) : 0), k2(rk4 ? count(elements) : 0),
      k3(rk4 ? count(elements) : 0), k4(rk4 ? count(elements) : 0);
  cuda::DeviceBuffer<T> normed(!continuous && settings.pre_norm ? count(elements) : 0);
  cuda::DeviceBuffer<T> head_delta(usa ? count(elements) : 0), head_lse(usa ? count(B * N) : 0);
  cuda::DeviceBuffer<T> entropy(count(B * N * max_heads));
  cuda::DeviceBuffer<double> betas_device(count(B));
  cuda::DeviceBuffer<double> observed(count(R * B * kObservableFields));
  cuda::DeviceBuffer<double> norms(count(scratch_sizes.norms)), row_sums(count(scratch_sizes.rows));
  cuda::DeviceBuffer<std::uint32_t> edges(count(scratch_sizes.edges));
  cuda::DeviceBuffer<int> labels(count(scratch_sizes.labels));
  ObserveScratch scratch;
  scratch.norms = norms.data();
  scratch.rows = row_sums.data();
  scratch.edges = edges.data();
  scratch.labels = labels.data();

  std::vector<DeviceLayer<T>> device_layers;
  device_layers.reserve(layers.size());
  for (const FlowLayer<T>& layer : layers) device_layers.push_back(upload_layer(layer, stream));
  state.copy_from_host(initial.data(), count(elements), stream);
  betas_device.copy_from_host(betas.data(), count(B), stream);

  // Runs [b0, b1) of consecutive clouds with one beta: one attend_async each.
  std::vector<std::pair<std::int64_t, std::int64_t>> runs;
  for (std::int64_t b0 = 0; b0 < B; b0 = runs.back().second) {
    runs.emplace_back(b0, beta_run_end(betas, b0));
  }

  // One workspace for every call of the run: the largest any call needs.
  std::size_t workspace_bytes = 0;
  for (const DeviceLayer<T>& layer : device_layers) {
    for (const auto& [b0, b1] : runs) {
      AttentionInput<T> in;
      in.batch = b1 - b0;
      in.tokens = N;
      in.dim = d;
      in.layer = layer.ops;
      if (usa) in.layer.heads = 1;
      AttentionOutput<T> out;
      out.update = update.data();
      workspace_bytes = std::max(workspace_bytes, cuda::attend_workspace_size(in, out));
    }
  }
  cuda::DeviceBuffer<unsigned char> workspace(workspace_bytes);

  // Calls attend_async on each run of `heads`-head operators; entropy_out may be null.
  const auto attend_runs = [&](const T* cloud, const LayerOperators<T>& ops, T* delta, T* lse,
                               T* entropy_out) {
    for (const auto& [b0, b1] : runs) {
      AttentionInput<T> in;
      in.cloud = cloud + b0 * N * d;
      in.batch = b1 - b0;
      in.tokens = N;
      in.dim = d;
      in.layer = ops;
      in.beta = betas[count(b0)];
      AttentionOutput<T> out;
      out.update = delta + b0 * N * d;
      out.lse = lse != nullptr ? lse + b0 * ops.heads * N : nullptr;
      out.entropy = entropy_out != nullptr ? entropy_out + b0 * ops.heads * N : nullptr;
      cuda::attend_async(in, out, workspace.data(), workspace_bytes, stream);
    }
  };

  const double log_tokens = std::log(static_cast<double>(N));
  // The attention update of `cloud` into `out` (SA or USA, tangent-projected on the sphere).
  // mean_entropy: null, or where the mean entropy of cloud b goes (stride kObservableFields).
  const auto drift = [&](const T* cloud, const DeviceLayer<T>& layer, T* out,
                         double* mean_entropy) {
    const std::int64_t H = layer.ops.heads;
    T* const entropy_out = mean_entropy != nullptr ? entropy.data() : nullptr;
    if (!usa) {
      // entropy: (B, H, N).
      attend_runs(cloud, layer.ops, out, nullptr, entropy_out);
      if (mean_entropy != nullptr) {
        launch_mean_entropy<T>(entropy.data(), batch, static_cast<int>(H), tokens, H * N, N,
                               mean_entropy, kObservableFields, stream);
      }
    } else {
      // USA: each head has its own Z_i, so heads are evaluated one at a time; c is a constant
      // drift, unscaled. entropy: (H, B, N).
      for (std::int64_t h = 0; h < H; ++h) {
        LayerOperators<T> head = layer.ops;
        head.heads = 1;
        head.relevance = layer.ops.relevance + h * d * d;
        head.content = layer.ops.content + h * d * d;
        head.key_bias = layer.ops.key_bias ? layer.ops.key_bias + h * d : nullptr;
        head.offset = nullptr;
        attend_runs(cloud, head, head_delta.data(), head_lse.data(),
                    entropy_out != nullptr ? entropy_out + h * B * N : nullptr);
        launch_usa_accumulate<T>(out, head_delta.data(), head_lse.data(), log_tokens, h == 0, rows,
                                 dim, stream);
      }
      if (layer.ops.offset != nullptr) {
        // The attention backend's kernel: every token of the B * N rows is visible here.
        emflow::detail::launch_add_offset<T>(out, layer.ops.offset, 1, rows, dim,
                                             emflow::detail::KernelMask{}, stream, kOperation);
      }
      if (mean_entropy != nullptr) {
        launch_mean_entropy<T>(entropy.data(), batch, static_cast<int>(H), tokens, N, B * N,
                               mean_entropy, kObservableFields, stream);
      }
    }
    if (tangent) launch_tangent<T>(cloud, out, rows, dim, stream);
  };
  const auto layer_of = [&](std::int64_t s) -> const DeviceLayer<T>& {
    return device_layers[device_layers.size() == 1 ? 0 : count(s)];
  };

  T* const x = state.data();
  if (tangent) {
    launch_normalize<T>(Normalization::sphere, x, x, rows, dim, nullptr, nullptr, stream);
  }

  double t = 0.0;
  std::int64_t r = 0;
  for (std::int64_t s = 0;; ++s) {
    const bool record = s % every == 0 || s == S;
    double* mean_entropy = nullptr;
    if (record) {
      // Into pageable host memory, so the copy returns only once it is done: one wait for the
      // stream per record, the price of handing the trajectory back as it is recorded.
      state.copy_to_host(result.trajectory.data() + r * elements, count(elements), stream);
      result.times[count(r)] = continuous ? t : static_cast<double>(s);
      result.steps[count(r)] = s;
      double* const observed_r = observed.data() + r * B * kObservableFields;
      launch_observe<T>(x, batch, tokens, dim, betas_device.data(), settings.cluster_eps, scratch,
                        observed_r, stream);
      mean_entropy = observed_r + kEntropy;
    }
    if (s == S) {
      // The entropy of the final state: one more evaluation (the last layer's operators).
      const DeviceLayer<T>& last = layer_of(continuous ? 0 : S - 1);
      const T* at = x;
      if (!continuous && settings.pre_norm) {
        launch_normalize<T>(settings.norm, x, normed.data(), rows, dim, last.gain, last.bias,
                            stream);
        at = normed.data();
      }
      drift(at, last, update.data(), mean_entropy);
      break;
    }

    if (continuous) {
      const double h = step_length(settings.time, settings.dt, S, s);
      const DeviceLayer<T>& layer = device_layers[0];
      drift(x, layer, update.data(), mean_entropy);
      if (!rk4) {
        launch_axpy<T>(x, x, update.data(), static_cast<T>(h), n, stream);
      } else {
        const T* k1 = update.data();
        launch_axpy<T>(stage.data(), x, k1, static_cast<T>(h / 2), n, stream);
        drift(stage.data(), layer, k2.data(), nullptr);
        launch_axpy<T>(stage.data(), x, k2.data(), static_cast<T>(h / 2), n, stream);
        drift(stage.data(), layer, k3.data(), nullptr);
        launch_axpy<T>(stage.data(), x, k3.data(), static_cast<T>(h), n, stream);
        drift(stage.data(), layer, k4.data(), nullptr);
        launch_rk4_combine<T>(x, k1, k2.data(), k3.data(), k4.data(), static_cast<T>(h / 6), n,
                              stream);
      }
      if (tangent) {
        launch_normalize<T>(Normalization::sphere, x, x, rows, dim, nullptr, nullptr, stream);
      }
      t += h;
    } else {
      const DeviceLayer<T>& layer = layer_of(s);
      if (settings.pre_norm) {
        launch_normalize<T>(settings.norm, x, normed.data(), rows, dim, layer.gain, layer.bias,
                            stream);
        drift(normed.data(), layer, update.data(), mean_entropy);
        launch_add<T>(x, update.data(), n, stream);
      } else {
        drift(x, layer, update.data(), mean_entropy);
        launch_add<T>(x, update.data(), n, stream);
        launch_normalize<T>(settings.norm, x, x, rows, dim, layer.gain, layer.bias, stream);
      }
    }
    if (record) ++r;
    if (progress) progress(s + 1, S);
  }

  std::vector<double> host_observed(count(R * B * kObservableFields));
  observed.copy_to_host(host_observed.data(), host_observed.size(), stream);
  // The host reads the observables (and the last trajectory copy) now.
  check_cuda(cudaStreamSynchronize(stream), kOperation, "cudaStreamSynchronize");
  for (std::size_t e = 0; e < result.observables.size(); ++e) {
    const double* o = host_observed.data() + e * kObservableFields;
    Observables& to = result.observables[e];
    to.min_inner = o[kMinInner];
    to.mean_inner = o[kMeanInner];
    to.clustered_fraction = o[kClusteredFraction];
    to.clusters = static_cast<std::int64_t>(o[kClusters]);
    to.energy = o[kEnergy];
    to.entropy = o[kEntropy];
    to.diameter = o[kDiameter];
  }
  return result;
}

template FlowResult<float> run_flow_cuda<float>(const Tensor<float>&, const std::vector<double>&,
                                                const std::vector<FlowLayer<float>>&,
                                                const FlowSettings&, const Progress&);
template FlowResult<double> run_flow_cuda<double>(const Tensor<double>&, const std::vector<double>&,
                                                  const std::vector<FlowLayer<double>>&,
                                                  const FlowSettings&, const Progress&);

}  // namespace emflow::flow::detail
