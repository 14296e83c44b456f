// The blocking CUDA paths behind emflow::attend, attend_factored and attend_partial on
// Device::cuda: host arrays are copied to device buffers on a stream of their own, a plan
// (cuda::AttentionPlan, plan.cpp) made for the call runs there, the outputs are copied back and
// the stream is synchronised. The arrays were validated on the host (their lengths too).
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>
#include <vector>

#include "core/backends.hpp"
#include "core/queries.hpp"
#include "cuda_support.hpp"
#include "emflow/capability.hpp"
#include "emflow/cuda.hpp"
#include "plan_access.hpp"

namespace emflow::detail {

namespace {

// Device copies of host arrays, owned until the call returns.
class Uploads {
 public:
  explicit Uploads(cudaStream_t stream) : stream_(stream) {}

  /// A device copy of `count` host values, or null for an absent array.
  template <class V>
  const V* of(const V* host, std::size_t count) {
    if (host == nullptr) return nullptr;
    auto& owned = buffers<V>();
    owned.emplace_back(count);
    owned.back().copy_from_host(host, count, stream_);
    return owned.back().data();
  }

  /// The input with every array on the device (its layer's too).
  template <class T>
  AttentionInput<T> input(const AttentionInput<T>& input) {
    const auto B = static_cast<std::size_t>(input.batch);
    const auto d = static_cast<std::size_t>(input.dim);
    const auto H = static_cast<std::size_t>(input.layer.heads);
    const auto N = static_cast<std::size_t>(input.tokens);
    const auto Nq = static_cast<std::size_t>(query_count(input));
    AttentionInput<T> on_device = input;
    on_device.cloud = of(input.cloud, B * N * d);
    on_device.queries = of(input.queries, B * Nq * d);
    on_device.key_lengths = of(input.key_lengths, B);
    on_device.query_lengths = of(input.query_lengths, B);
    on_device.query_positions = of(input.query_positions, B);
    on_device.layer.relevance = of(input.layer.relevance, H * d * d);
    on_device.layer.content = of(input.layer.content, H * d * d);
    on_device.layer.key_bias = of(input.layer.key_bias, H * d);
    on_device.layer.offset = of(input.layer.offset, d);
    return on_device;
  }

  template <class T>
  FactoredLayer<T> layer(const FactoredLayer<T>& layer, std::int64_t dim) {
    const auto H = static_cast<std::size_t>(layer.heads);
    const auto K = static_cast<std::size_t>(layer.key_heads());  // grouped heads: K < H
    const auto r = static_cast<std::size_t>(layer.rank);
    const auto d = static_cast<std::size_t>(dim);
    FactoredLayer<T> on_device = layer;
    on_device.query_factor = of(layer.query_factor, H * r * d);
    on_device.key_factor = of(layer.key_factor, K * r * d);
    on_device.content_up = of(layer.content_up, H * d * r);
    on_device.content_down = of(layer.content_down, K * r * d);
    on_device.key_bias = of(layer.key_bias, H * d);
    on_device.offset = of(layer.offset, d);
    return on_device;
  }

 private:
  template <class V>
  std::vector<cuda::DeviceBuffer<V>>& buffers() {
    if constexpr (std::is_same_v<V, std::int64_t>) {
      return lengths_;
    } else if constexpr (std::is_same_v<V, double>) {
      return doubles_;
    } else if constexpr (std::is_same_v<V, float>) {
      return floats_;
    } else if constexpr (std::is_same_v<V, bfloat16>) {
      return bfloats_;
    } else {
      return halves_;
    }
  }

  cudaStream_t stream_;
  std::vector<cuda::DeviceBuffer<std::int64_t>> lengths_;
  std::vector<cuda::DeviceBuffer<double>> doubles_;
  std::vector<cuda::DeviceBuffer<float>> floats_;
  std::vector<cuda::DeviceBuffer<bfloat16>> bfloats_;
  std::vector<cuda::DeviceBuffer<float16>> halves_;
};

// The outputs of an update on the device, copied back to the host's.
template <class T>
struct DeviceOutputs {
  cuda::DeviceBuffer<T> update;
  cuda::DeviceBuffer<Stat<T>> lse, entropy, weights;
  AttentionOutput<T> on_device;

  DeviceOutputs(const AttentionOutput<T>& host, std::size_t values, std::size_t rows,
                std::size_t tokens)
      : update(values),
        lse(host.lse ? rows : 0),
        entropy(host.entropy ? rows : 0),
        weights(host.weights ? rows * tokens : 0) {
    on_device.update = update.data();
    on_device.lse = host.lse ? lse.data() : nullptr;
    on_device.entropy = host.entropy ? entropy.data() : nullptr;
    on_device.weights = host.weights ? weights.data() : nullptr;
  }

  void copy_to(const AttentionOutput<T>& host, cudaStream_t s) const {
    update.copy_to_host(host.update, update.size(), s);
    if (host.lse) lse.copy_to_host(host.lse, lse.size(), s);
    if (host.entropy) entropy.copy_to_host(host.entropy, entropy.size(), s);
    if (host.weights) weights.copy_to_host(host.weights, weights.size(), s);
  }
};

// The plan options of the route that core chose (route(), capability.hpp): its algorithm (the
// tensor cores take Algorithm::automatic) and the precision of its products. The plan asks
// route() again with them and comes to the same kernel.
cuda::PlanOptions options_of(const Route& route) {
  cuda::PlanOptions options;
  switch (route.kernel) {
    case Kernel::cuda_fused:
      options.algorithm = cuda::Algorithm::fused;
      break;
    case Kernel::cuda_unfused:
      options.algorithm = cuda::Algorithm::unfused;
      break;
    default:
      options.algorithm = cuda::Algorithm::automatic;
      break;
  }
  options.precision = route.products;
  return options;
}

}  // namespace

template <class T>
void cuda_attend(const AttentionInput<T>& input, const AttentionOutput<T>& output,
                 const Route& route) {
  const char* const operation = "attend";
  // The stream is declared first so it outlives every buffer: on an error path the buffers are
  // freed (cudaFree waits for the device) before the stream is destroyed.
  const OwnedStream stream(operation);
  const cudaStream_t s = stream.get();
  const auto B = static_cast<std::size_t>(input.batch);
  const auto H = static_cast<std::size_t>(input.layer.heads);
  const auto Nq = static_cast<std::size_t>(query_count(input));
  const auto d = static_cast<std::size_t>(input.dim);
  Uploads uploads(s);
  const AttentionInput<T> in = uploads.input(input);
  const DeviceOutputs<T> out(output, B * Nq * d, B * H * Nq,
                             static_cast<std::size_t>(input.tokens));
  const cuda::PlanOptions options = options_of(route);
  const cuda::AttentionPlan<T> plan =
      cuda::detail::PlanAccess::make(operation, in, out.on_device, options);
  cuda::DeviceBuffer<unsigned char> workspace(plan.workspace_size());
  plan.run(in, out.on_device, workspace.data(), workspace.size(), s);
  out.copy_to(output, s);
  check_cuda(cudaStreamSynchronize(s), operation, "cudaStreamSynchronize");
}

template <class T>
void cuda_attend_factored(const AttentionInput<T>& input, const FactoredLayer<T>& layer,
                          const AttentionOutput<T>& output, const Route& route) {
  const char* const operation = "attend_factored";
  const OwnedStream stream(operation);  // first: see cuda_attend
  const cudaStream_t s = stream.get();
  const auto B = static_cast<std::size_t>(input.batch);
  const auto H = static_cast<std::size_t>(layer.heads);
  const auto Nq = static_cast<std::size_t>(query_count(input));
  const auto d = static_cast<std::size_t>(input.dim);
  Uploads uploads(s);
  const AttentionInput<T> in = uploads.input(input);
  const FactoredLayer<T> f = uploads.layer(layer, input.dim);
  const DeviceOutputs<T> out(output, B * Nq * d, B * H * Nq,
                             static_cast<std::size_t>(input.tokens));
  const cuda::PlanOptions options = options_of(route);
  const cuda::AttentionPlan<T> plan =
      cuda::detail::PlanAccess::make(operation, in, f, out.on_device, options);
  cuda::DeviceBuffer<unsigned char> workspace(plan.workspace_size());
  plan.run(in, f, out.on_device, workspace.data(), workspace.size(), s);
  out.copy_to(output, s);
  check_cuda(cudaStreamSynchronize(s), operation, "cudaStreamSynchronize");
}

template <class T>
void cuda_attend_partial(const AttentionInput<T>& input, const PartialOutput<T>& output,
                         const Route& route) {
  const char* const operation = "attend_partial";
  const OwnedStream stream(operation);  // first: see cuda_attend
  const cudaStream_t s = stream.get();
  const auto H = static_cast<std::size_t>(input.layer.heads);
  const std::size_t rows =
      static_cast<std::size_t>(input.batch) * H * static_cast<std::size_t>(query_count(input));
  const std::size_t values = rows * static_cast<std::size_t>(input.dim);
  Uploads uploads(s);
  const AttentionInput<T> in = uploads.input(input);
  cuda::DeviceBuffer<T> heads(values), lse(rows), entropy(rows);
  const PartialOutput<T> out{heads.data(), lse.data(), entropy.data()};
  const cuda::AttentionPlan<T> plan =
      cuda::detail::PlanAccess::make(operation, in, out, options_of(route));
  cuda::DeviceBuffer<unsigned char> workspace(plan.workspace_size());
  plan.run(in, out, workspace.data(), workspace.size(), s);
  heads.copy_to_host(output.heads, values, s);
  lse.copy_to_host(output.lse, rows, s);
  entropy.copy_to_host(output.entropy, rows, s);
  check_cuda(cudaStreamSynchronize(s), operation, "cudaStreamSynchronize");
}

#define EMFLOW_INSTANTIATE_BLOCKING(T)                                                             \
  template void cuda_attend<T>(const AttentionInput<T>&, const AttentionOutput<T>&, const Route&); \
  template void cuda_attend_factored<T>(const AttentionInput<T>&, const FactoredLayer<T>&,         \
                                        const AttentionOutput<T>&, const Route&);
EMFLOW_INSTANTIATE_BLOCKING(float)
EMFLOW_INSTANTIATE_BLOCKING(double)
EMFLOW_INSTANTIATE_BLOCKING(bfloat16)
EMFLOW_INSTANTIATE_BLOCKING(float16)
#undef EMFLOW_INSTANTIATE_BLOCKING
template void cuda_attend_partial<float>(const AttentionInput<float>&, const PartialOutput<float>&,
                                         const Route&);
template void cuda_attend_partial<double>(const AttentionInput<double>&,
                                          const PartialOutput<double>&, const Route&);

}  // namespace emflow::detail
