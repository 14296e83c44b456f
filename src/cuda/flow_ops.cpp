// The flow in device memory: the operations of stepper.hpp on cuda::DeviceBuffer. Every
// attention evaluation runs an attention plan made once per configuration before the run
// (cuda::AttentionPlan, emflow/cuda.hpp), on one owned stream, with one workspace sized for the
// largest; the
// element-wise parts and the observables are the kernels of kernels/flow_kernels.hpp. The host
// only enqueues, and waits where it needs data: for the copy of the record before last at each
// record (page-locked staging, so the stream keeps its work) and for the stream at the end (the
// observables). Compiled only with CUDA.
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "core/check.hpp"
#include "cuda_support.hpp"
#include "emflow/cuda.hpp"
#include "flow/internal.hpp"
#include "flow/stepper.hpp"
#include "kernels/attention_kernels.hpp"
#include "kernels/flow_kernels.hpp"
#include "plan_access.hpp"

namespace emflow::flow::detail {

namespace {

using emflow::detail::check_cuda;
using emflow::detail::fail;

// One layer's operators in one device allocation, and the host copy they were uploaded from:
// kept until the layer goes, as the upload is asynchronous (declared first, so freed after the
// device buffer, whose cudaFree waits for the device).
template <class T>
struct DeviceLayer {
  std::vector<T> packed;
  cuda::DeviceBuffer<T> storage;
  LayerView<T> view;
};

// A recorded state on its way to the trajectory: copied from the device into page-locked memory
// (a copy queued on the stream that does not drain it), then into the trajectory by the host
// once the event says it is there.
struct StagedRecord {
  explicit StagedRecord(const char* operation) : copied(operation) {}
  emflow::detail::PinnedBuffer buffer;
  emflow::detail::OwnedEvent copied;
  void* to = nullptr;  // where in the trajectory; null: nothing pending
  std::size_t bytes = 0;
};

// The kernels and launches index with int: refuse what does not fit before allocating.
void check_fits_int(const char* operation, std::int64_t value, const char* what) {
  if (value > INT_MAX) {
    fail(ErrorCode::unsupported, operation, ": ", what, " = ", value,
         " exceeds the CUDA flow's limit of ", INT_MAX);
  }
}

int to_int(std::int64_t value) { return static_cast<int>(value); }

template <class T>
class DeviceOps {
 public:
  using Value = T;
  using Buffer = cuda::DeviceBuffer<T>;

  // Every buffer of the run is declared after the ops, so they are freed (cudaFree waits for
  // the device) before the stream is destroyed.
  explicit DeviceOps(const char* operation)
      : operation_(operation), owned_(operation), stream_(owned_.get()) {
    for (int k = 0; k < 2; ++k) staging_.push_back(std::make_unique<StagedRecord>(operation));
  }

  cudaStream_t stream() const noexcept { return stream_; }

  Buffer allocate(std::size_t count) { return Buffer(count); }

  DeviceLayer<T> upload(const FlowLayer<T>& layer) {
    const std::vector<T>* parts[] = {&layer.relevance, &layer.content,   &layer.key_bias,
                                     &layer.offset,    &layer.norm_gain, &layer.norm_bias};
    DeviceLayer<T> device;
    std::vector<T>& packed = device.packed;
    for (const std::vector<T>* part : parts) {
      packed.insert(packed.end(), part->begin(), part->end());
    }
    device.storage = Buffer(packed.size());
    // Asynchronous: `packed` stays alive with the layer until the copy has run (moving the layer
    // keeps its heap block where it is).
    device.storage.copy_from_host(packed.data(), packed.size(), stream_);
    const T* cursor = device.storage.data();
    const T* at[6];
    for (std::size_t p = 0; p < 6; ++p) {
      at[p] = parts[p]->empty() ? nullptr : cursor;
      cursor += parts[p]->size();
    }
    device.view.ops.heads = layer.heads;
    device.view.ops.relevance = at[0];
    device.view.ops.content = at[1];
    device.view.ops.key_bias = at[2];
    device.view.ops.offset = at[3];
    device.view.gain = at[4];
    device.view.bias = at[5];
    return device;
  }

  // One plan per configuration the run will call (a handful: runs of clouds sharing beta, with
  // and without entropy), made before the first step with every check and device query, so a
  // step only enqueues.
  void reserve(const AttentionInput<T>& in, const AttentionOutput<T>& out) {
    if (plan_for(in, out) != nullptr) return;
    plans_.push_back(cuda::detail::PlanAccess::make(operation_, in, out, cuda::PlanOptions{}));
    workspace_bytes_ = std::max(workspace_bytes_, plans_.back().workspace_size());
  }
  // One workspace for every call of the run: the largest any plan needs.
  void ready() { workspace_ = cuda::DeviceBuffer<unsigned char>(workspace_bytes_); }

  // The one place the flow's attention is enqueued.
  void attend(const AttentionInput<T>& in, const AttentionOutput<T>& out) {
    const cuda::AttentionPlan<T>* plan = plan_for(in, out);
    if (plan == nullptr) {
      fail(ErrorCode::internal, operation_, ": an attention call of a configuration ",
           "that was not reserved before the run");
    }
    plan->run(in, out, workspace_.data(), workspace_.size(), stream_);
  }

  void axpy(T* y, const T* x, const T* k, T step, std::int64_t n) {
    launch_axpy<T>(y, x, k, step, to_int(n), stream_);
  }
  void rk4_combine(T* x, const T* k1, const T* k2, const T* k3, const T* k4, T sixth,
                   std::int64_t n) {
    launch_rk4_combine<T>(x, k1, k2, k3, k4, sixth, to_int(n), stream_);
  }
  void add(T* x, const T* delta, std::int64_t n) { launch_add<T>(x, delta, to_int(n), stream_); }
  void normalize(Normalization norm, const T* in, T* out, std::int64_t rows, std::int64_t dim,
                 const T* gain, const T* bias) {
    launch_normalize<T>(norm, in, out, to_int(rows), to_int(dim), gain, bias, stream_);
  }
  void tangent(const T* cloud, T* update, std::int64_t rows, std::int64_t dim) {
    launch_tangent<T>(cloud, update, to_int(rows), to_int(dim), stream_);
  }
  void usa_accumulate(T* update, const T* delta, const T* lse, double log_tokens, bool first,
                      std::int64_t rows, std::int64_t dim) {
    launch_usa_accumulate<T>(update, delta, lse, log_tokens, first, to_int(rows), to_int(dim),
                             stream_);
  }
  void add_offset(T* update, const T* offset, std::int64_t rows, std::int64_t dim) {
    // The attention backend's kernel: every token of the B * N rows is visible here.
    emflow::detail::launch_add_offset<T>(update, offset, 1, to_int(rows), to_int(dim),
                                         emflow::detail::KernelMask{}, stream_, operation_);
  }
  void mean_entropy(const T* entropy, std::int64_t batch, std::int64_t heads, std::int64_t tokens,
                    std::int64_t cloud_stride, std::int64_t head_stride, EntropySink sink) {
    launch_mean_entropy<T>(entropy, to_int(batch), to_int(heads), to_int(tokens), cloud_stride,
                           head_stride, sink.at, to_int(sink.stride), stream_);
  }

  /// Records go to `result`: the observables of B clouds of N tokens, at `betas`, stay on the
  /// device until finish().
  void record_into(const std::vector<double>& betas, std::int64_t tokens, double cluster_eps,
                   std::size_t records) {
    const ObserveScratchSizes sizes =
        observe_scratch_sizes(static_cast<std::int64_t>(betas.size()), tokens);
    cluster_eps_ = cluster_eps;
    betas_ = cuda::DeviceBuffer<double>(betas.size());
    observed_ = cuda::DeviceBuffer<double>(records * betas.size() * kObservableFields);
    norms_ = cuda::DeviceBuffer<double>(static_cast<std::size_t>(sizes.norms));
    rows_ = cuda::DeviceBuffer<double>(static_cast<std::size_t>(sizes.rows));
    parents_ = cuda::DeviceBuffer<int>(static_cast<std::size_t>(sizes.parents));
    betas_.copy_from_host(betas.data(), betas.size(), stream_);
  }

  EntropySink record(const T* x, std::int64_t r, FlowResult<T>& result) {
    const Shape& shape = result.trajectory.shape();
    const std::int64_t B = shape[1], N = shape[2], d = shape[3];
    // Into page-locked staging, one of two used in turn, so the stream is never drained: the
    // host waits only for the copy of the record before last, while this one's work runs.
    StagedRecord& slot = *staging_[next_slot_];
    next_slot_ = (next_slot_ + 1) % staging_.size();
    deliver(slot);
    const auto bytes = static_cast<std::size_t>(B * N * d) * sizeof(T);
    if (slot.buffer.bytes() < bytes) slot.buffer = emflow::detail::PinnedBuffer(bytes, operation_);
    check_cuda(cudaMemcpyAsync(slot.buffer.data(), x, bytes, cudaMemcpyDeviceToHost, stream_),
               operation_, "cudaMemcpyAsync (record to page-locked staging)");
    slot.copied.record(stream_);
    slot.to = result.trajectory.data() + r * B * N * d;
    slot.bytes = bytes;
    double* const observed = observed_.data() + r * B * kObservableFields;
    ObserveScratch scratch;
    scratch.norms = norms_.data();
    scratch.rows = rows_.data();
    scratch.parents = parents_.data();
    launch_observe<T>(x, to_int(B), to_int(N), to_int(d), betas_.data(), cluster_eps_, scratch,
                      observed, stream_);
    return {observed + kEntropy, kObservableFields};
  }

  /// The observables of every record into the result (the host waits for the stream).
  void finish(FlowResult<T>& result) {
    std::vector<double> host(observed_.size());
    observed_.copy_to_host(host.data(), host.size(), stream_);
    check_cuda(cudaStreamSynchronize(stream_), operation_, "cudaStreamSynchronize");
    for (const auto& slot : staging_) deliver(*slot);
    for (std::size_t e = 0; e < result.observables.size(); ++e) {
      const double* o = host.data() + e * kObservableFields;
      Observables& to = result.observables[e];
      to.min_inner = o[kMinInner];
      to.mean_inner = o[kMeanInner];
      to.clustered_fraction = o[kClusteredFraction];
      to.clusters = static_cast<std::int64_t>(o[kClusters]);
      to.energy = o[kEnergy];
      to.entropy = o[kEntropy];
      to.diameter = o[kDiameter];
    }
  }

  /// The state on the host: one copy and one wait for the stream.
  const T* to_host(const T* x, std::vector<T>& scratch, std::int64_t n) {
    scratch.resize(static_cast<std::size_t>(n));
    cuda::detail::copy_device_to_host(scratch.data(), x, scratch.size() * sizeof(T), stream_);
    check_cuda(cudaStreamSynchronize(stream_), operation_, "cudaStreamSynchronize");
    return scratch.data();
  }

 private:
  // A staged record into the trajectory, once its copy has completed.
  static void deliver(StagedRecord& slot) {
    if (slot.to == nullptr) return;
    slot.copied.wait();
    std::memcpy(slot.to, slot.buffer.data(), slot.bytes);
    slot.to = nullptr;
  }

  const char* operation_;
  const emflow::detail::OwnedStream owned_;
  cudaStream_t stream_;
  const cuda::AttentionPlan<T>* plan_for(const AttentionInput<T>& in,
                                         const AttentionOutput<T>& out) const {
    for (const auto& plan : plans_) {
      if (plan.matches(in, out)) return &plan;
    }
    return nullptr;
  }

  std::vector<cuda::AttentionPlan<T>> plans_;
  std::size_t workspace_bytes_ = 0;
  cuda::DeviceBuffer<unsigned char> workspace_;
  double cluster_eps_ = 0.0;
  cuda::DeviceBuffer<double> betas_, observed_, norms_, rows_;
  cuda::DeviceBuffer<int> parents_;
  // Last, so freed first (cudaFreeHost waits for the device's copies into them).
  std::vector<std::unique_ptr<StagedRecord>> staging_;
  std::size_t next_slot_ = 0;
};

// Refuses a batch of B clouds of N tokens in R^d with `heads` heads (and, when `observed`, the
// observables' scratch) whose sizes do not fit the kernels' int indexing, before anything is
// allocated; returns B * N * d. Then checks that no CUDA error is pending: launch failures are
// read back with cudaGetLastError, so an error the caller left is reported as such before
// anything is enqueued.
std::int64_t check_sizes(const char* operation, std::int64_t B, std::int64_t N, std::int64_t d,
                         std::int64_t heads, bool observed) {
  using emflow::detail::checked_multiply;
  const std::int64_t elements =
      checked_multiply(operation, "initial", checked_multiply(operation, "initial", B, N), d);
  check_fits_int(operation, elements, "batch * tokens * dim");
  check_fits_int(operation, checked_multiply(operation, "layers", B * N, heads),
                 "batch * tokens * heads");
  if (observed) {
    const ObserveScratchSizes sizes = observe_scratch_sizes(B, N);
    check_fits_int(operation, sizes.rows, "batch * tokens * 5 (observables)");
  }
  emflow::detail::check_no_pending_error(operation);
  return elements;
}

}  // namespace

template <class T>
FlowResult<T> run_flow_device(const Tensor<T>& initial, const std::vector<double>& betas,
                              const std::vector<FlowLayer<T>>& layers, const FlowSettings& settings,
                              const Progress& progress) {
  constexpr const char* kOperation = "run_flow";
  const std::int64_t B = initial.extent(0), N = initial.extent(1), d = initial.extent(2);
  std::int64_t max_heads = 1;
  for (const FlowLayer<T>& layer : layers) max_heads = std::max(max_heads, layer.heads);
  // Shapes first, allocations after.
  const std::int64_t elements = check_sizes(kOperation, B, N, d, max_heads, true);
  FlowResult<T> result = allocate_result<T>(B, N, d, settings);

  DeviceOps<T> ops(kOperation);
  ops.record_into(betas, N, settings.cluster_eps, result.times.size());
  std::vector<DeviceLayer<T>> device_layers;
  std::vector<LayerView<T>> views;
  for (const FlowLayer<T>& layer : layers) {
    device_layers.push_back(ops.upload(layer));
    views.push_back(device_layers.back().view);
  }
  cuda::DeviceBuffer<T> state(static_cast<std::size_t>(elements));
  state.copy_from_host(initial.data(), state.size(), ops.stream());
  run_recorded(ops, state.data(), views, betas, settings, result, progress);
  ops.finish(result);
  return result;
}

std::vector<double> phase_generic_device(const PhaseProblem& problem, const Progress& progress) {
  constexpr const char* kOperation = "phase";
  const std::int64_t elements =
      check_sizes(kOperation, problem.batch, problem.tokens, problem.dim, 1, false);
  DeviceOps<float> ops(kOperation);
  const DeviceLayer<float> identity =
      ops.upload(make_layer<float>(problem.dim, OperatorKind::identity, OperatorKind::identity, 0));
  cuda::DeviceBuffer<float> state(static_cast<std::size_t>(elements));
  state.copy_from_host(problem.clouds.data(), state.size(), ops.stream());
  return phase_stepped(ops, state.data(), identity.view, problem, progress);
}

#define EMFLOW_DEVICE_FLOW_INSTANTIATE(T)                                                          \
  template class Stepper<DeviceOps<T>>;                                                            \
  template FlowResult<T> run_flow_device<T>(const Tensor<T>&, const std::vector<double>&,          \
                                            const std::vector<FlowLayer<T>>&, const FlowSettings&, \
                                            const Progress&);

EMFLOW_DEVICE_FLOW_INSTANTIATE(float)
EMFLOW_DEVICE_FLOW_INSTANTIATE(double)
#undef EMFLOW_DEVICE_FLOW_INSTANTIATE

}  // namespace emflow::flow::detail
