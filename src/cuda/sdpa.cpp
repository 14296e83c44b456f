// The blocking CUDA paths of emflow::sdpa_attend and sdpa_backward (include/emflow/sdpa.hpp) on
// Device::cuda: the caller's host arrays copied to the device on a stream of their own, the
// stream-ordered call (src/cuda/sdpa_async.cpp: the float32 or tensor-core kernels forward, the
// float32 or tensor-core backward kernels) run on the copies, the results copied back in the
// caller's types and the stream synchronised. One path for both forms, so they give the same
// bits. The arguments were validated and routed by core/sdpa.cpp (route(); non-finite input
// taken by the reference there).
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "core/backends.hpp"
#include "cuda_support.hpp"
#include "emflow/cuda.hpp"

namespace emflow::detail {

namespace {

/// A device copy of `count` host values, or an empty buffer for an absent array.
template <class V>
cuda::DeviceBuffer<V> upload(const V* host, std::size_t count, cudaStream_t stream) {
  if (host == nullptr) return cuda::DeviceBuffer<V>();
  cuda::DeviceBuffer<V> buffer(count);
  buffer.copy_from_host(host, count, stream);
  return buffer;
}

/// A device array of `count` values for a host output, or an empty buffer for an absent one.
template <class V>
cuda::DeviceBuffer<V> room_for(const V* host, std::size_t count) {
  return host != nullptr ? cuda::DeviceBuffer<V>(count) : cuda::DeviceBuffer<V>();
}

template <class V>
V* data_or_null(cuda::DeviceBuffer<V>& buffer) {
  return buffer.size() > 0 ? buffer.data() : nullptr;
}

template <class V>
void download(const cuda::DeviceBuffer<V>& buffer, V* host, cudaStream_t stream) {
  if (host != nullptr) buffer.copy_to_host(host, buffer.size(), stream);
}

/// The device copies of an SDPA input (Q, K, V, the lengths and positions) and the input that
/// points at them.
template <class T>
class DeviceInput {
 public:
  DeviceInput(const SdpaInput<T>& in, cudaStream_t stream)
      : queries_(
            upload(in.queries, count(in.batch, in.query_heads, in.query_tokens, in.rank), stream)),
        keys_(upload(in.keys, count(in.batch, in.kv_heads, in.tokens, in.rank), stream)),
        values_(upload(in.values, count(in.batch, in.kv_heads, in.tokens, in.value_rank), stream)),
        key_lengths_(upload(in.key_lengths, count(in.batch), stream)),
        query_lengths_(upload(in.query_lengths, count(in.batch), stream)),
        query_positions_(upload(in.query_positions, count(in.batch), stream)),
        input_(in) {
    input_.queries = queries_.data();
    input_.keys = keys_.data();
    input_.values = values_.data();
    input_.key_lengths = data_or_null(key_lengths_);
    input_.query_lengths = data_or_null(query_lengths_);
    input_.query_positions = data_or_null(query_positions_);
  }
  const SdpaInput<T>& get() const noexcept { return input_; }

  static std::size_t count(std::int64_t a, std::int64_t b = 1, std::int64_t c = 1,
                           std::int64_t d = 1) {
    return static_cast<std::size_t>(a * b * c * d);
  }

 private:
  cuda::DeviceBuffer<T> queries_, keys_, values_;
  cuda::DeviceBuffer<std::int64_t> key_lengths_, query_lengths_, query_positions_;
  SdpaInput<T> input_;
};

/// A device workspace of `bytes` (none for 0).
cuda::DeviceBuffer<unsigned char> workspace_of(std::size_t bytes) {
  return bytes > 0 ? cuda::DeviceBuffer<unsigned char>(bytes) : cuda::DeviceBuffer<unsigned char>();
}

}  // namespace

template <class T>
void cuda_sdpa_attend(const SdpaInput<T>& input, const SdpaOutput<T>& output, Precision precision) {
  // The stream first, so that it outlives every buffer (as in attend_blocking.cpp).
  const OwnedStream stream("sdpa_attend");
  const cudaStream_t s = stream.get();
  const DeviceInput<T> in(input, s);
  const std::size_t rows =
      DeviceInput<T>::count(input.batch, input.query_heads, input.query_tokens);
  cuda::DeviceBuffer<T> out(rows * static_cast<std::size_t>(input.value_rank));
  cuda::DeviceBuffer<Stat<T>> lse = room_for(output.lse, rows);
  cuda::DeviceBuffer<Stat<T>> entropy = room_for(output.entropy, rows);
  const SdpaOutput<T> device_output{out.data(), data_or_null(lse), data_or_null(entropy)};
  cuda::PlanOptions options;
  options.precision = precision;
  cuda::DeviceBuffer<unsigned char> workspace =
      workspace_of(cuda::sdpa_workspace_size(in.get(), device_output, options));
  cuda::sdpa_attend_async(in.get(), device_output, data_or_null(workspace), workspace.size(), s,
                          options);
  download(out, output.output, s);
  download(lse, output.lse, s);
  download(entropy, output.entropy, s);
  check_cuda(cudaStreamSynchronize(s), "sdpa_attend", "cudaStreamSynchronize");
}

template <class T>
void cuda_sdpa_backward(const SdpaInput<T>& input, const SdpaSaved<T>& saved,
                        const UpstreamGradients<T>& upstream,
                        const SdpaGradientOutput<T>& gradients) {
  const OwnedStream stream("sdpa_backward");  // first: see cuda_sdpa_attend
  const cudaStream_t s = stream.get();
  const DeviceInput<T> in(input, s);
  const std::size_t rows =
      DeviceInput<T>::count(input.batch, input.query_heads, input.query_tokens);
  const std::size_t kv = DeviceInput<T>::count(input.batch, input.kv_heads, input.tokens);
  const auto r = static_cast<std::size_t>(input.rank);
  const auto rv = static_cast<std::size_t>(input.value_rank);
  cuda::DeviceBuffer<T> output = upload(saved.output, rows * rv, s);
  cuda::DeviceBuffer<Stat<T>> lse = upload(saved.lse, rows, s);
  cuda::DeviceBuffer<Stat<T>> entropy = upload(saved.entropy, rows, s);
  cuda::DeviceBuffer<T> output_gradient = upload(upstream.update, rows * rv, s);
  cuda::DeviceBuffer<Stat<T>> lse_gradient = upload(upstream.lse, rows, s);
  cuda::DeviceBuffer<Stat<T>> entropy_gradient = upload(upstream.entropy, rows, s);
  cuda::DeviceBuffer<T> dq(rows * r), dk(kv * r), dv(kv * rv);
  cuda::DeviceBuffer<double> dscale = room_for(gradients.scale, 1);
  const SdpaSaved<T> device_saved{data_or_null(output), data_or_null(lse), data_or_null(entropy)};
  const UpstreamGradients<T> device_upstream{
      data_or_null(output_gradient), data_or_null(lse_gradient), data_or_null(entropy_gradient)};
  const SdpaGradientOutput<T> device_gradients{dq.data(), dk.data(), dv.data(),
                                               data_or_null(dscale)};
  cuda::DeviceBuffer<unsigned char> workspace =
      workspace_of(cuda::sdpa_backward_workspace_size(in.get(), device_upstream, device_gradients));
  cuda::sdpa_backward_async(in.get(), device_saved, device_upstream, device_gradients,
                            data_or_null(workspace), workspace.size(), s);
  download(dq, gradients.queries, s);
  download(dk, gradients.keys, s);
  download(dv, gradients.values, s);
  download(dscale, gradients.scale, s);
  check_cuda(cudaStreamSynchronize(s), "sdpa_backward", "cudaStreamSynchronize");
}

#define EMFLOW_CUDA_SDPA_BLOCKING(T)                                                       \
  template void cuda_sdpa_attend<T>(const SdpaInput<T>&, const SdpaOutput<T>&, Precision); \
  template void cuda_sdpa_backward<T>(const SdpaInput<T>&, const SdpaSaved<T>&,            \
                                      const UpstreamGradients<T>&, const SdpaGradientOutput<T>&);
EMFLOW_CUDA_SDPA_BLOCKING(float)
EMFLOW_CUDA_SDPA_BLOCKING(bfloat16)
EMFLOW_CUDA_SDPA_BLOCKING(float16)
#undef EMFLOW_CUDA_SDPA_BLOCKING

}  // namespace emflow::detail
