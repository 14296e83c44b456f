// The dense EMF form on the tensor cores (tc_dense.cpp), a strategy of cuda::AttentionPlan
// (plan_strategy.hpp): what route() sends to cuda_tensor_cores for the dense form, bfloat16 and
// float16 storage and float with Precision::tf32. T is bfloat16, float16 or float (TF32
// operands).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "emflow/attention.hpp"
#include "emflow/capability.hpp"
#include "plan_strategy.hpp"
#include "products_strategy.hpp"
#include "tc_state.hpp"

namespace emflow::detail {

template <class T>
class TcDenseStrategy final : public PlanStrategy<T> {
 public:
  /// The strategy of `problem` (the update of a dense layer, validated and routed);
  /// `key_splits` as PlanOptions::key_splits (the float kernel's rule, choose_key_splits).
  TcDenseStrategy(const Problem& problem, int key_splits, const char* operation);

  std::size_t workspace_bytes() const noexcept override { return total_; }
  int key_splits() const noexcept override { return state_.key_splits(); }
  void bind(int device, bool prepare, const char* operation) override;
  void run(const PlanCall<T>& call, unsigned char* workspace, cudaStream_t stream,
           const char* operation) const override;

 private:
  int batch_ = 0, tokens_ = 0, queries_ = 0, dim_ = 0, heads_ = 0;
  // Where each array lives in the workspace (byte offsets, each aligned).
  std::size_t query_ = 0, value_ = 0, bias_ = 0;
  std::size_t total_ = 0;
  TcAttentionState state_;  // the head outputs and the key splits' states
  bool key_bias_ = false;
};

extern template class TcDenseStrategy<bfloat16>;
extern template class TcDenseStrategy<float16>;
extern template class TcDenseStrategy<float>;

}  // namespace emflow::detail
