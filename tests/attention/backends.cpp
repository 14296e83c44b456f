#include "attention/backends.hpp"

#include <gtest/gtest.h>

#include <ostream>

namespace emflow::testing {

std::string Target::name() const {
  const char* names[] = {"reference", "cpu", "cuda", "cuda_fused", "cuda_unfused"};
  std::string out = names[static_cast<int>(backend)];
  if (backend == Backend::cpu && threads != 2) out += "_t" + std::to_string(threads);
  return out + (is_double ? "_f64" : "_f32");
}

bool Target::accepts(std::int64_t dim, bool weights) const {
  if (backend != Backend::cuda_fused) return true;
  return !is_double && !weights && dim <= 256;
}

const std::vector<Target>& all_targets() {
  static const std::vector<Target> targets = {
      {Backend::reference, true},   {Backend::reference, false},    {Backend::cpu, false},
      {Backend::cpu, true},         {Backend::cuda, false},         {Backend::cuda, true},
      {Backend::cuda_fused, false}, {Backend::cuda_unfused, false}, {Backend::cuda_unfused, true}};
  return targets;
}

bool target_present(const Target& target, std::string* reason) {
  if (!target.is_cuda()) return true;
  std::string why;
  if (cuda_available(&why)) return true;
  if (reason) *reason = "no CUDA device: " + why;
  return false;
}

std::ostream& operator<<(std::ostream& out, const Target& target) { return out << target.name(); }

template <class T>
void run_on(const Target& target, Buffers<T>& buffers) {
  switch (target.backend) {
    case Backend::reference:
      attend(buffers.input, buffers.output, {Device::reference});
      return;
    case Backend::cpu:
      attend(buffers.input, buffers.output, {Device::cpu, target.threads});
      return;
    case Backend::cuda:
      attend(buffers.input, buffers.output, {Device::cuda});
      return;
    case Backend::cuda_fused:
    case Backend::cuda_unfused:
#if defined(EMFLOW_WITH_CUDA)
      run_async(buffers, target.backend == Backend::cuda_fused ? cuda::Algorithm::fused
                                                               : cuda::Algorithm::unfused);
#else
      ADD_FAILURE() << target.name() << " needs a CUDA build";
#endif
      return;
  }
}

template void run_on(const Target&, Buffers<float>&);
template void run_on(const Target&, Buffers<double>&);

#if defined(EMFLOW_WITH_CUDA)

CudaStream::CudaStream() {
  EXPECT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
}

CudaStream::~CudaStream() {
  if (stream != nullptr) cudaStreamDestroy(stream);
}

template <class T>
DeviceProblem<T>::DeviceProblem(const Buffers<T>& host, cudaStream_t stream)
    : cloud(host.cloud.size()),
      relevance(host.relevance.size()),
      content(host.content.size()),
      bias(host.bias.size()),
      shift(host.shift.size()),
      update(host.update.size()),
      lse(host.lse.size()),
      entropy(host.entropy.size()),
      weights(host.weights.size()),
      lengths(host.input.key_lengths ? static_cast<std::size_t>(host.input.batch) : 0) {
  cloud.copy_from_host(host.cloud.data(), host.cloud.size(), stream);
  relevance.copy_from_host(host.relevance.data(), host.relevance.size(), stream);
  content.copy_from_host(host.content.data(), host.content.size(), stream);
  bias.copy_from_host(host.bias.data(), host.bias.size(), stream);
  shift.copy_from_host(host.shift.data(), host.shift.size(), stream);
  // The outputs start as the host's NaN bit patterns, so whatever is not written shows.
  update.copy_from_host(host.update.data(), host.update.size(), stream);
  lse.copy_from_host(host.lse.data(), host.lse.size(), stream);
  entropy.copy_from_host(host.entropy.data(), host.entropy.size(), stream);
  weights.copy_from_host(host.weights.data(), host.weights.size(), stream);
  if (host.input.key_lengths)
    lengths.copy_from_host(host.input.key_lengths, lengths.size(), stream);
  input = host.input;
  input.cloud = cloud.data();
  input.layer.relevance = relevance.data();
  input.layer.content = content.data();
  input.layer.key_bias = host.input.layer.key_bias ? bias.data() : nullptr;
  input.layer.offset = host.input.layer.offset ? shift.data() : nullptr;
  input.key_lengths = host.input.key_lengths ? lengths.data() : nullptr;
  output.update = update.data();
  output.lse = host.output.lse ? lse.data() : nullptr;
  output.entropy = host.output.entropy ? entropy.data() : nullptr;
  output.weights = host.output.weights ? weights.data() : nullptr;
}

template <class T>
void DeviceProblem<T>::download(Buffers<T>& host, cudaStream_t stream) const {
  update.copy_to_host(host.update.data(), host.update.size(), stream);
  lse.copy_to_host(host.lse.data(), host.lse.size(), stream);
  entropy.copy_to_host(host.entropy.data(), host.entropy.size(), stream);
  weights.copy_to_host(host.weights.data(), host.weights.size(), stream);
}

template <class T>
void run_async(Buffers<T>& host, cuda::Algorithm algorithm) {
  CudaStream s;
  DeviceProblem<T> device(host, s.stream);
  const std::size_t bytes = cuda::attend_workspace_size(device.input, device.output, {algorithm});
  cuda::DeviceBuffer<unsigned char> workspace(bytes);
  cuda::attend_async(device.input, device.output, workspace.data(), bytes, s.stream, {algorithm});
  device.download(host, s.stream);
  ASSERT_EQ(cudaStreamSynchronize(s.stream), cudaSuccess);
}

template struct DeviceProblem<float>;
template struct DeviceProblem<double>;
template void run_async(Buffers<float>&, cuda::Algorithm);
template void run_async(Buffers<double>&, cuda::Algorithm);

#endif  // EMFLOW_WITH_CUDA

}  // namespace emflow::testing
