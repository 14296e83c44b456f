// The blocking CUDA paths behind emflow::attend(..., {Device::cuda}) and
// emflow::attend_partial(..., {Device::cuda}): host arrays are copied to device buffers on a
// stream of their own, attend_async / attend_partial_async runs there, the outputs are copied
// back and the stream is synchronised.
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>
#include <vector>

#include "core/backends.hpp"
#include "cuda_support.hpp"
#include "emflow/cuda.hpp"

namespace emflow::detail {

namespace {

// The inputs of one call on the device; `on_device` points at them.
template <class T>
struct DeviceInputs {
  cuda::DeviceBuffer<T> cloud, queries, relevance, content, bias, offset;
  cuda::DeviceBuffer<std::int64_t> key_lengths, query_lengths, query_positions;
  AttentionInput<T> on_device;

  DeviceInputs(const AttentionInput<T>& input, cudaStream_t s) {
    const auto B = static_cast<std::size_t>(input.batch);
    const auto d = static_cast<std::size_t>(input.dim);
    const auto H = static_cast<std::size_t>(input.layer.heads);
    const std::size_t keys = B * static_cast<std::size_t>(input.tokens) * d;
    const std::size_t asked =
        input.queries ? B * static_cast<std::size_t>(input.query_tokens) * d : 0;
    cloud = cuda::DeviceBuffer<T>(keys);
    queries = cuda::DeviceBuffer<T>(asked);
    relevance = cuda::DeviceBuffer<T>(H * d * d);
    content = cuda::DeviceBuffer<T>(H * d * d);
    bias = cuda::DeviceBuffer<T>(input.layer.key_bias ? H * d : 0);
    offset = cuda::DeviceBuffer<T>(input.layer.offset ? d : 0);
    key_lengths = cuda::DeviceBuffer<std::int64_t>(input.key_lengths ? B : 0);
    query_lengths = cuda::DeviceBuffer<std::int64_t>(input.query_lengths ? B : 0);
    query_positions = cuda::DeviceBuffer<std::int64_t>(input.query_positions ? B : 0);
    cloud.copy_from_host(input.cloud, keys, s);
    if (input.queries) queries.copy_from_host(input.queries, asked, s);
    relevance.copy_from_host(input.layer.relevance, H * d * d, s);
    content.copy_from_host(input.layer.content, H * d * d, s);
    if (input.layer.key_bias) bias.copy_from_host(input.layer.key_bias, H * d, s);
    if (input.layer.offset) offset.copy_from_host(input.layer.offset, d, s);
    if (input.key_lengths) key_lengths.copy_from_host(input.key_lengths, B, s);
    if (input.query_lengths) query_lengths.copy_from_host(input.query_lengths, B, s);
    if (input.query_positions) query_positions.copy_from_host(input.query_positions, B, s);
    on_device = input;
    on_device.cloud = cloud.data();
    on_device.queries = input.queries ? queries.data() : nullptr;
    on_device.layer.relevance = relevance.data();
    on_device.layer.content = content.data();
    on_device.layer.key_bias = input.layer.key_bias ? bias.data() : nullptr;
    on_device.layer.offset = input.layer.offset ? offset.data() : nullptr;
    on_device.key_lengths = input.key_lengths ? key_lengths.data() : nullptr;
    on_device.query_lengths = input.query_lengths ? query_lengths.data() : nullptr;
    on_device.query_positions = input.query_positions ? query_positions.data() : nullptr;
  }
};

template <class T>
std::size_t query_count(const AttentionInput<T>& input) {
  return static_cast<std::size_t>(input.queries ? input.query_tokens : input.tokens);
}

// The algorithm that route() chose (the tensor cores take Algorithm::automatic).
cuda::Algorithm algorithm_of(const Route& route) {
  switch (route.kernel) {
    case Kernel::cuda_fused:
      return cuda::Algorithm::fused;
    case Kernel::cuda_unfused:
      return cuda::Algorithm::unfused;
    default:
      return cuda::Algorithm::automatic;
  }
}

}  // namespace

template <class T>
void cuda_attend(const AttentionInput<T>& input, const AttentionOutput<T>& output,
                 const Route& route) {
  const Precision precision = route.products;
  const char* const operation = "attend";
  // The stream is declared first so it outlives every buffer: on an error path the buffers are
  // freed (cudaFree waits for the device) before the stream is destroyed.
  const OwnedStream stream(operation);
  const cudaStream_t s = stream.get();
  const auto B = static_cast<std::size_t>(input.batch);
  const auto N = static_cast<std::size_t>(input.tokens);
  const auto d = static_cast<std::size_t>(input.dim);
  const auto H = static_cast<std::size_t>(input.layer.heads);
  const std::size_t Nq = query_count(input);
  const std::size_t update_size = B * Nq * d, rows = B * H * Nq;

  const DeviceInputs<T> inputs(input, s);
  cuda::DeviceBuffer<T> update(update_size);
  cuda::DeviceBuffer<Stat<T>> lse(output.lse ? rows : 0), entropy(output.entropy ? rows : 0);
  cuda::DeviceBuffer<Stat<T>> weights(output.weights ? rows * N : 0);
  AttentionOutput<T> to_device;
  to_device.update = update.data();
  to_device.lse = output.lse ? lse.data() : nullptr;
  to_device.entropy = output.entropy ? entropy.data() : nullptr;
  to_device.weights = output.weights ? weights.data() : nullptr;

  const cuda::Algorithm algorithm = algorithm_of(route);
  const std::size_t bytes =
      cuda::attend_workspace_size(inputs.on_device, to_device, algorithm, precision);
  cuda::DeviceBuffer<unsigned char> workspace(bytes);
  cuda::attend_async(inputs.on_device, to_device, workspace.data(), bytes, s, algorithm, precision);

  update.copy_to_host(output.update, update_size, s);
  if (output.lse) lse.copy_to_host(output.lse, rows, s);
  if (output.entropy) entropy.copy_to_host(output.entropy, rows, s);
  if (output.weights) weights.copy_to_host(output.weights, rows * N, s);
  check_cuda(cudaStreamSynchronize(s), operation, "cudaStreamSynchronize");
}

template <class T>
void cuda_attend_partial(const AttentionInput<T>& input, const PartialOutput<T>& output,
                         const Route& route) {
  const char* const operation = "attend_partial";
  const OwnedStream stream(operation);  // first: see cuda_attend
  const cudaStream_t s = stream.get();
  const auto H = static_cast<std::size_t>(input.layer.heads);
  const std::size_t rows = static_cast<std::size_t>(input.batch) * H * query_count(input);
  const std::size_t values = rows * static_cast<std::size_t>(input.dim);

  const DeviceInputs<T> inputs(input, s);
  cuda::DeviceBuffer<T> heads(values), lse(rows), entropy(rows);
  const PartialOutput<T> to_device{heads.data(), lse.data(), entropy.data()};
  const cuda::Algorithm algorithm = algorithm_of(route);
  const std::size_t bytes = cuda::attend_partial_workspace_size(inputs.on_device, algorithm);
  cuda::DeviceBuffer<unsigned char> workspace(bytes);
  cuda::attend_partial_async(inputs.on_device, to_device, workspace.data(), bytes, s, algorithm);

  heads.copy_to_host(output.heads, values, s);
  lse.copy_to_host(output.lse, rows, s);
  entropy.copy_to_host(output.entropy, rows, s);
  check_cuda(cudaStreamSynchronize(s), operation, "cudaStreamSynchronize");
}

template <class T>
void cuda_attend_factored(const AttentionInput<T>& input, const FactoredLayer<T>& layer,
                          const AttentionOutput<T>& output, const Route& route) {
  const char* const operation = "attend_factored";
  const Precision precision = route.products;
  const OwnedStream stream(operation);  // first: see cuda_attend
  const cudaStream_t s = stream.get();
  const auto B = static_cast<std::size_t>(input.batch);
  const auto d = static_cast<std::size_t>(input.dim);
  const auto H = static_cast<std::size_t>(layer.heads);
  const auto r = static_cast<std::size_t>(layer.rank);
  const std::size_t Nq = query_count(input), rows = B * H * Nq;
  std::vector<cuda::DeviceBuffer<T>> arrays;
  std::vector<cuda::DeviceBuffer<std::int64_t>> lengths;
  arrays.reserve(8);
  lengths.reserve(3);
  // A device copy of `count` host values, or null for an absent array.
  auto upload = [s](auto& owner, const auto* host, std::size_t count) {
    using V = std::remove_const_t<std::remove_pointer_t<decltype(host)>>;
    if (host == nullptr) return static_cast<const V*>(nullptr);
    owner.emplace_back(count);
    owner.back().copy_from_host(host, count, s);
    return static_cast<const V*>(owner.back().data());
  };
  AttentionInput<T> in = input;
  in.cloud = upload(arrays, input.cloud, B * static_cast<std::size_t>(input.tokens) * d);
  in.queries = upload(arrays, input.queries, input.queries ? B * Nq * d : 0);
  in.key_lengths = upload(lengths, input.key_lengths, B);
  in.query_lengths = upload(lengths, input.query_lengths, B);
  in.query_positions = upload(lengths, input.query_positions, B);
  FactoredLayer<T> f = layer;
  f.query_factor = upload(arrays, layer.query_factor, H * r * d);
  f.key_factor = upload(arrays, layer.key_factor, H * r * d);
  f.content_up = upload(arrays, layer.content_up, H * d * r);
  f.content_down = upload(arrays, layer.content_down, H * r * d);
  f.key_bias = upload(arrays, layer.key_bias, H * d);
  f.offset = upload(arrays, layer.offset, d);

  cuda::DeviceBuffer<T> update(B * Nq * d);
  cuda::DeviceBuffer<Stat<T>> lse(output.lse ? rows : 0), entropy(output.entropy ? rows : 0);
  AttentionOutput<T> to_device;
  to_device.update = update.data();
  to_device.lse = output.lse ? lse.data() : nullptr;
  to_device.entropy = output.entropy ? entropy.data() : nullptr;
  to_device.weights = output.weights;
  const std::size_t bytes = cuda::attend_factored_workspace_size(in, f, to_device, precision);
  cuda::DeviceBuffer<unsigned char> workspace(bytes);
  cuda::attend_factored_async(in, f, to_device, workspace.data(), bytes, s, precision);
  update.copy_to_host(output.update, B * Nq * d, s);
  if (output.lse) lse.copy_to_host(output.lse, rows, s);
  if (output.entropy) entropy.copy_to_host(output.entropy, rows, s);
  check_cuda(cudaStreamSynchronize(s), operation, "cudaStreamSynchronize");
}

template void cuda_attend_factored<bfloat16>(const AttentionInput<bfloat16>&,
                                             const FactoredLayer<bfloat16>&,
                                             const AttentionOutput<bfloat16>&, const Route&);
template void cuda_attend_factored<float16>(const AttentionInput<float16>&,
                                            const FactoredLayer<float16>&,
                                            const AttentionOutput<float16>&, const Route&);
template void cuda_attend_factored<float>(const AttentionInput<float>&, const FactoredLayer<float>&,
                                          const AttentionOutput<float>&, const Route&);
template void cuda_attend<float>(const AttentionInput<float>&, const AttentionOutput<float>&,
                                 const Route&);
template void cuda_attend<double>(const AttentionInput<double>&, const AttentionOutput<double>&,
                                  const Route&);
template void cuda_attend<bfloat16>(const AttentionInput<bfloat16>&,
                                    const AttentionOutput<bfloat16>&, const Route&);
template void cuda_attend<float16>(const AttentionInput<float16>&, const AttentionOutput<float16>&,
                                   const Route&);
template void cuda_attend_partial<float>(const AttentionInput<float>&, const PartialOutput<float>&,
                                         const Route&);
template void cuda_attend_partial<double>(const AttentionInput<double>&,
                                          const PartialOutput<double>&, const Route&);

}  // namespace emflow::detail
