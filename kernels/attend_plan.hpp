// A plan of the CUDA attention for one configuration (shapes, mask, outputs, algorithm): made
// once, with every check and device query, and enqueued many times, each enqueue only launching.
// emflow::cuda::attend_async (cuda.hpp) is a plan made and enqueued in one call, after checking
// the caller's pointers.
//
// Workspace (each region aligned to 256 bytes, in this order):
//   relevance  (heads, batch * tokens, dim)  Q_h = scale (X M_h + 1 u_h^T); scale = beta for the
//              unfused path and beta log2(e) for the fused one (its softmax is in base 2)
//   content    (heads, batch * tokens, dim)  C_h = X F_h^T
//   scores     (batch, heads, tokens, tokens) unfused only, when `weights` is not requested
//   partial    (heads, batch, tokens, dim)   fused only, when heads > 1 (per-head updates,
//              summed in head order by sum_heads_kernel so the result is deterministic)
//   cublas     cuBLAS's own scratch (cublasSetWorkspace)
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "emflow/attention.hpp"
#include "emflow/cuda.hpp"

namespace emflow::detail {

struct CublasApi;

/// Byte offsets of the workspace regions (see above) and the total size.
struct WorkspaceLayout {
  std::size_t relevance = 0, content = 0, scores = 0, partial = 0, cublas = 0;
  std::size_t total = 0;
};

/// Alignment of the workspace and of each region in it (cudaMalloc's).
constexpr std::size_t kWorkspaceAlignment = 256;

template <class T>
class AttentionPlan {
 public:
  /// Validates shapes, mask, beta and which outputs are requested (null or not), chooses the
  /// algorithm, lays out the workspace, and, when `query_device` is true, checks that a device
  /// is usable and queries it once (current device, opt-in shared-memory limit for the fused
  /// kernel), raises the fused kernel's dynamic shared-memory attribute once (not per launch)
  /// and loads cuBLAS. Reads no array. Throws emflow::Error as attend_async does.
  AttentionPlan(const AttentionInput<T>& shapes, const AttentionOutput<T>& outputs,
                cuda::Algorithm algorithm, const char* operation, bool query_device = true);

  std::size_t workspace_bytes() const noexcept { return layout_.total; }

  /// True when enqueue would accept this call's shapes, mask and outputs: for callers that keep
  /// one plan per configuration and pick the one a call needs.
  bool matches(const AttentionInput<T>& input, const AttentionOutput<T>& output) const noexcept;
  cuda::Algorithm algorithm() const noexcept { return algorithm_; }
  /// The device that was current when the plan was made (-1 for a sizing-only plan).
  int device() const noexcept { return device_; }

  /// Enqueues on `stream`, on the device that was current when the plan was made. Checks only
  /// that the call matches the plan (the same batch, tokens, dim, heads, mask, the same outputs
  /// present, a non-null update; integer compares, no CUDA API query), then launches. Pointers
  /// are trusted device pointers; `beta` and the pointers may differ from call to call.
  /// `workspace` holds workspace_bytes(), 256-byte aligned. Never synchronises, allocates
  /// nothing. A plan made with query_device = false (for sizing) is refused.
  void enqueue(const AttentionInput<T>& input, const AttentionOutput<T>& output, void* workspace,
               cudaStream_t stream) const;

 private:
  void check_matches(const AttentionInput<T>& input, const AttentionOutput<T>& output) const;

  std::string operation_;
  std::int64_t batch_ = 0, tokens_ = 0, dim_ = 0, heads_ = 0;
  Mask mask_;
  bool lse_ = false, entropy_ = false, weights_ = false;
  cuda::Algorithm algorithm_ = cuda::Algorithm::unfused;
  WorkspaceLayout layout_;
  int device_ = -1;                    // -1: made without querying the device
  const CublasApi* cublas_ = nullptr;  // loaded with the device query
};

extern template class AttentionPlan<float>;
extern template class AttentionPlan<double>;

}  // namespace emflow::detail
