// The blocking CUDA path behind emflow::attend(..., {Device::cuda}): host arrays are copied to
// device buffers on a stream of its own, attend_async runs there, the outputs are copied back
// and the stream is synchronised.
#include <cuda_runtime.h>

#include <cstdint>

#include "core/backends.hpp"
#include "cuda_support.hpp"
#include "emflow/cuda.hpp"

namespace emflow::detail {

template <class T>
void cuda_attend(const AttentionInput<T>& input, const AttentionOutput<T>& output) {
  const char* const operation = "attend";
  // The stream is declared first so it outlives every buffer: on an error path the buffers are
  // freed (cudaFree waits for the device) before the stream is destroyed.
  const OwnedStream stream(operation);
  const cudaStream_t s = stream.get();
  const auto B = static_cast<std::size_t>(input.batch);
  const auto N = static_cast<std::size_t>(input.tokens);
  const auto d = static_cast<std::size_t>(input.dim);
  const auto H = static_cast<std::size_t>(input.layer.heads);
  const std::size_t cloud_size = B * N * d, operator_size = H * d * d, rows = B * H * N;

  cuda::DeviceBuffer<T> cloud(cloud_size), relevance(operator_size), content(operator_size);
  cuda::DeviceBuffer<T> bias(input.layer.key_bias ? H * d : 0);
  cuda::DeviceBuffer<T> offset(input.layer.offset ? d : 0);
  cuda::DeviceBuffer<std::int64_t> lengths(input.key_lengths ? B : 0);
  cuda::DeviceBuffer<T> update(cloud_size);
  cuda::DeviceBuffer<T> lse(output.lse ? rows : 0), entropy(output.entropy ? rows : 0);
  cuda::DeviceBuffer<T> weights(output.weights ? rows * N : 0);

  cloud.copy_from_host(input.cloud, cloud_size, s);
  relevance.copy_from_host(input.layer.relevance, operator_size, s);
  content.copy_from_host(input.layer.content, operator_size, s);
  if (input.layer.key_bias) bias.copy_from_host(input.layer.key_bias, H * d, s);
  if (input.layer.offset) offset.copy_from_host(input.layer.offset, d, s);
  if (input.key_lengths) lengths.copy_from_host(input.key_lengths, B, s);

  AttentionInput<T> on_device = input;
  on_device.cloud = cloud.data();
  on_device.layer.relevance = relevance.data();
  on_device.layer.content = content.data();
  on_device.layer.key_bias = input.layer.key_bias ? bias.data() : nullptr;
  on_device.layer.offset = input.layer.offset ? offset.data() : nullptr;
  on_device.key_lengths = input.key_lengths ? lengths.data() : nullptr;
  AttentionOutput<T> to_device;
  to_device.update = update.data();
  to_device.lse = output.lse ? lse.data() : nullptr;
  to_device.entropy = output.entropy ? entropy.data() : nullptr;
  to_device.weights = output.weights ? weights.data() : nullptr;

  const std::size_t bytes = cuda::attend_workspace_size(on_device, to_device);
  cuda::DeviceBuffer<unsigned char> workspace(bytes);
  cuda::attend_async(on_device, to_device, workspace.data(), bytes, s);

  update.copy_to_host(output.update, cloud_size, s);
  if (output.lse) lse.copy_to_host(output.lse, rows, s);
  if (output.entropy) entropy.copy_to_host(output.entropy, rows, s);
  if (output.weights) weights.copy_to_host(output.weights, rows * N, s);
  check_cuda(cudaStreamSynchronize(s), operation, "cudaStreamSynchronize");
}

template void cuda_attend<float>(const AttentionInput<float>&, const AttentionOutput<float>&);
template void cuda_attend<double>(const AttentionInput<double>&, const AttentionOutput<double>&);

}  // namespace emflow::detail
