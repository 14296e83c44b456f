// What the library's own CUDA code needs of cuda::AttentionPlan (emflow/cuda.hpp, plan.cpp) beyond
// its public interface: plans whose errors name the calling operation (the one-call wrappers of
// attend_async.cpp and sdpa_async.cpp, the blocking paths, the flow), and the device decode cache's
// plan (decode_strategy.hpp), which runs its own calls.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "decode_strategy.hpp"
#include "emflow/cuda.hpp"

namespace emflow::cuda::detail {

struct PlanAccess {
  /// The plans of cuda.hpp's constructors, their errors (when made and when run) naming
  /// `operation`.
  template <class T>
  static AttentionPlan<T> make(const char* operation, const AttentionInput<T>& input,
                               const AttentionOutput<T>& output, const PlanOptions& options);
  template <class T>
  static AttentionPlan<T> make(const char* operation, const AttentionInput<T>& input,
                               const FactoredLayer<T>& layer, const AttentionOutput<T>& output,
                               const PlanOptions& options);
  template <class T>
  static AttentionPlan<T> make(const char* operation, const AttentionInput<T>& input,
                               const PartialOutput<T>& output, const PlanOptions& options);
  template <class T>
  static AttentionPlan<T> make(const char* operation, const SdpaInput<T>& input,
                               const SdpaOutput<T>& output, const PlanOptions& options);
  template <class T>
  static AttentionPlan<T> make(const char* operation, const SdpaInput<T>& input,
                               const UpstreamGradients<T>& upstream,
                               const SdpaGradientOutput<T>& gradients,
                               const SdpaBackwardOptions& options);

  /// AttentionPlan::get_workspace_size, its errors naming `operation`.
  template <class T>
  static std::size_t workspace_size(const char* operation, const AttentionInput<T>& input,
                                    const AttentionOutput<T>& output, const PlanOptions& options);
  template <class T>
  static std::size_t workspace_size(const char* operation, const AttentionInput<T>& input,
                                    const FactoredLayer<T>& layer, const AttentionOutput<T>& output,
                                    const PlanOptions& options);
  template <class T>
  static std::size_t workspace_size(const char* operation, const AttentionInput<T>& input,
                                    const PartialOutput<T>& output, const PlanOptions& options);
  template <class T>
  static std::size_t workspace_size(const char* operation, const SdpaInput<T>& input,
                                    const SdpaOutput<T>& output, const PlanOptions& options);
  template <class T>
  static std::size_t workspace_size(const char* operation, const SdpaInput<T>& input,
                                    const UpstreamGradients<T>& upstream,
                                    const SdpaGradientOutput<T>& gradients,
                                    const SdpaBackwardOptions& options);

  /// The plan of a device decode cache of `shape` on the current device: route() asked for
  /// Operation::decode, the fused kernel readied there, the workspace laid out for the capacity.
  static AttentionPlan<float> decode(const char* operation,
                                     const emflow::detail::DecodeShape& shape);
  /// One run of a decode plan: as AttentionPlan::run (the plan's device made current, a stream
  /// of another device or a pending error refused), then DecodeStrategy::run_decode.
  static void run_decode(const AttentionPlan<float>& plan, const emflow::detail::DecodeCall& call,
                         void* workspace, std::size_t workspace_bytes, cudaStream_t stream);
};

}  // namespace emflow::cuda::detail
