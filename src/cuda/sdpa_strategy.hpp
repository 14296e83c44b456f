// The SDPA-shaped operator's forward pass (emflow/sdpa.hpp) as a strategy of cuda::AttentionPlan
// (plan_strategy.hpp), defined in sdpa_async.cpp: on the caller's projected queries, keys and
// values as they are, the float32 kernel (kernels/sdpa_backward.cu) where route() names
// Kernel::cuda_fused (float with Precision::fp32), else the tensor-core attention kernel
// (bfloat16, float16, float with Precision::tf32; key splits by the fused kernel's rule or
// PlanOptions::key_splits), the 16-bit output rounded to T once by a kernel.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "emflow/capability.hpp"
#include "plan_strategy.hpp"
#include "products_strategy.hpp"

namespace emflow::detail {

template <class T>
class SdpaStrategy final : public PlanStrategy<T> {
 public:
  /// The strategy of `problem` (Operation::sdpa, validated and routed to `kernel`);
  /// `key_splits` as PlanOptions::key_splits (the tensor-core kernel only).
  SdpaStrategy(const Problem& problem, Kernel kernel, int key_splits, const char* operation);

  std::size_t workspace_bytes() const noexcept override { return bytes_; }
  int key_splits() const noexcept override { return splits_.splits; }
  void bind(int device, bool prepare, const char* operation) override;
  void run(const PlanCall<T>& call, unsigned char* workspace, cudaStream_t stream,
           const char* operation) const override;

 private:
  bool float32_ = false;  // the float32 kernel (Kernel::cuda_fused), no key splits
  int width_ = 0;         // max(rank, value_rank): the float32 kernel's shared-memory width
  int rank_ = 0;
  KeySplits splits_;
  // Where each array lives in the workspace (byte offsets, each aligned; absent ones unused):
  // the float32 output of 16-bit storage, lse when the run does not ask for it (the kernels
  // write it), the key splits' partial states.
  std::size_t out_ = 0, lse_ = 0, split_out_ = 0, split_lse_ = 0, split_entropy_ = 0;
  bool own_out_ = false, own_lse_ = false;
  std::size_t bytes_ = 0;
};

extern template class SdpaStrategy<float>;
extern template class SdpaStrategy<bfloat16>;
extern template class SdpaStrategy<float16>;

}  // namespace emflow::detail
