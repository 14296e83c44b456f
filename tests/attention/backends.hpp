// The attention backends as test targets: one name, one precision and one way of running a
// problem each, so every attention test is written once and instantiated for all of them.
//
//   reference_f64, reference_f32   emflow::attend on Device::reference
//   cpu_f32, cpu_f64               Device::cpu on two threads (the double path is the reference)
//   cuda_f32, cuda_f64             the blocking emflow::attend on Device::cuda (host arrays)
//   cuda_fused_f32                 cuda::attend_async, Algorithm::fused, on device buffers
//   cuda_unfused_f32, _f64         cuda::attend_async, Algorithm::unfused, on device buffers
#pragma once

#include <ostream>
#include <string>
#include <vector>

#include "common/testing.hpp"
#include "emflow/attention.hpp"

#if defined(EMFLOW_WITH_CUDA)
#include <cuda_runtime.h>

#include "emflow/cuda.hpp"
#endif

namespace emflow::testing {

enum class Backend { reference, cpu, cuda, cuda_fused, cuda_unfused };

struct Target {
  Backend backend;
  bool is_double;
  int threads = 2;  // Device::cpu only

  /// "cuda_fused_f32": the first part of a test case's name.
  std::string name() const;
  bool is_cuda() const { return backend != Backend::reference && backend != Backend::cpu; }
  /// Whether the target returns the N x N weights on request.
  bool offers_weights() const { return backend != Backend::cuda_fused; }
  /// Whether the target accepts this shape (the fused kernel: dim <= 256, float, no weights).
  bool accepts(std::int64_t dim, bool weights) const;
  /// The accuracy contract against the double reference (docs/MATH.md §6).
  double tolerance() const { return is_double ? 1e-12 : 1e-5; }
};

/// Every target, whether or not this build or machine can run it.
const std::vector<Target>& all_targets();

/// True when the target can run here; otherwise `reason` says why ("no CUDA device: ...").
bool target_present(const Target& target, std::string* reason);

/// Computes `buffers` (host arrays, outputs poisoned) on the target.
template <class T>
void run_on(const Target& target, Buffers<T>& buffers);

std::ostream& operator<<(std::ostream& out, const Target& target);

/// One case of a suite that runs every case on every target (Case has name(), dim, weights).
template <class Case>
struct OnTarget {
  Target target;
  Case c;
};

/// Every target crossed with every case it accepts.
template <class Case>
std::vector<OnTarget<Case>> on_every_target(const std::vector<Case>& cases) {
  std::vector<OnTarget<Case>> out;
  for (const Target& t : all_targets()) {
    for (const Case& c : cases) {
      if (t.accepts(c.dim, c.weights)) out.push_back({t, c});
    }
  }
  return out;
}

/// "cpu_f32_<case name>": the test name of an OnTarget parameter.
template <class Case>
std::string on_target_name(const ::testing::TestParamInfo<OnTarget<Case>>& info) {
  return info.param.target.name() + "_" + info.param.c.name();
}

template <class Case>
std::ostream& operator<<(std::ostream& out, const OnTarget<Case>& p) {
  return out << p.target.name() << "_" << p.c.name();
}

}  // namespace emflow::testing

/// Skips the current test with the reason when `target` cannot run here.
#define EMFLOW_REQUIRE_TARGET(target)                                       \
  do {                                                                      \
    std::string emflow_skip_reason;                                         \
    if (!::emflow::testing::target_present((target), &emflow_skip_reason))  \
      GTEST_SKIP() << emflow_skip_reason << " (" << (target).name() << ")"; \
  } while (0)

#if defined(EMFLOW_WITH_CUDA)
namespace emflow::testing {

/// A non-blocking stream owned by a test.
struct CudaStream {
  cudaStream_t stream = nullptr;
  CudaStream();
  ~CudaStream();
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;
};

/// A host problem's arrays on the device (outputs carry the host's NaN poison), with device-side
/// AttentionInput/Output pointing at them.
template <class T>
struct DeviceProblem {
  cuda::DeviceBuffer<T> cloud, relevance, content, bias, shift, update, lse, entropy, weights;
  cuda::DeviceBuffer<std::int64_t> lengths;
  AttentionInput<T> input;
  AttentionOutput<T> output;

  DeviceProblem(const Buffers<T>& host, cudaStream_t stream);
  void download(Buffers<T>& host, cudaStream_t stream) const;
};

/// One problem through attend_async on a caller's stream with a caller's workspace.
template <class T>
void run_async(Buffers<T>& host, cuda::Algorithm algorithm);

}  // namespace emflow::testing
#endif
