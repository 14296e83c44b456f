// The SDPA-shaped operator (emflow/sdpa.hpp) as strategies of cuda::AttentionPlan
// (plan_strategy.hpp), defined in sdpa_async.cpp, on the caller's projected queries, keys and
// values as they are. The forward pass: the float32 kernel (kernels/sdpa_backward.cu) where
// route() names Kernel::cuda_fused (float with Precision::fp32), else the tensor-core attention
// kernel (bfloat16, float16, float with Precision::tf32; key splits by the fused kernel's rule or
// PlanOptions::key_splits), the 16-bit output rounded to T once by a kernel. The backward pass:
// the row terms' kernel, then the backward kernels (float32 for float, the tensor cores for
// 16-bit storage, dQ per query tile or by atomics), the gradients rounded to T and the dscale
// terms summed by kernels.
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

template <class T>
class SdpaBackwardStrategy final : public PlanStrategy<T> {
 public:
  /// The strategy of `problem` (Operation::sdpa_backward, validated and routed) with `form`'s
  /// optional arrays.
  SdpaBackwardStrategy(const Problem& problem, const SdpaBackwardForm& form, const char* operation);

  std::size_t workspace_bytes() const noexcept override { return bytes_; }
  void bind(int device, bool prepare, const char* operation) override;
  void run(const PlanCall<T>& call, unsigned char* workspace, cudaStream_t stream,
           const char* operation) const override;

 private:
  SdpaBackwardForm form_;
  int width_ = 0;   // max(rank, value_rank)
  int blocks_ = 0;  // of the kernel that writes the dscale terms
  // Byte offsets in the workspace: the float32 gradients of 16-bit storage, the row arrays, dH
  // in float32 and the dscale terms where given.
  std::size_t query_gradient_ = 0, key_gradient_ = 0, value_gradient_ = 0;
  std::size_t output_gradient_ = 0, lse_ = 0, row_term_ = 0, entropy_gradient_ = 0;
  std::size_t scale_terms_ = 0, bytes_ = 0;
};

extern template class SdpaStrategy<float>;
extern template class SdpaStrategy<bfloat16>;
extern template class SdpaStrategy<float16>;
extern template class SdpaBackwardStrategy<float>;
extern template class SdpaBackwardStrategy<bfloat16>;
extern template class SdpaBackwardStrategy<float16>;

}  // namespace emflow::detail
