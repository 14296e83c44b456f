// The factored form expanded to dense operators on the device, a strategy of cuda::AttentionPlan
// (plan_strategy.hpp): where route() says `expanded` for Device::cuda (float with fp32 products,
// double, and TF32 where the tensor cores do not take the factored layer), cuBLAS forms
//
//   M_h = A_h^T B_h  and  F_h = U_h V_h    (d x d each, in T: 2 H d^2 r multiply-adds)
//
// into the workspace, and the dense strategy route() names (the fused or unfused product path,
// or the dense tensor cores in TF32) runs on them with the layer's key bias and offset. The
// expansion is small beside the attention (4 B H N^2 d) for any N beyond a few d.
//
// Workspace (each region aligned to 256 bytes): M (heads, d, d), F (heads, d, d), cuBLAS's scratch
// for the expansion, then the dense strategy's own workspace.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <memory>

#include "emflow/capability.hpp"
#include "emflow/factored.hpp"
#include "plan_strategy.hpp"

namespace emflow::detail {

struct CublasApi;

template <class T>
class ExpandedStrategy final : public PlanStrategy<T> {
 public:
  /// The strategy of `problem` (the update of a factored layer, validated) around `dense`, the
  /// strategy of the same problem in the dense form.
  ExpandedStrategy(const Problem& problem, std::unique_ptr<PlanStrategy<T>> dense,
                   const char* operation);

  std::size_t workspace_bytes() const noexcept override { return total_; }
  int key_splits() const noexcept override { return dense_->key_splits(); }
  void bind(int device, bool prepare, const char* operation) override;
  void run(const PlanCall<T>& call, unsigned char* workspace, cudaStream_t stream,
           const char* operation) const override;

 private:
  std::unique_ptr<PlanStrategy<T>> dense_;
  int dim_ = 0, heads_ = 0, rank_ = 0;
  std::size_t relevance_ = 0, content_ = 0, cublas_region_ = 0, dense_region_ = 0, total_ = 0;
  int device_ = -1;
  const CublasApi* cublas_ = nullptr;  // loaded when the plan is prepared
};

extern template class ExpandedStrategy<float>;
extern template class ExpandedStrategy<double>;

}  // namespace emflow::detail
