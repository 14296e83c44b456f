// The factored EMF form on the tensor cores (tc_factored.cpp), a strategy of cuda::AttentionPlan
// (plan_strategy.hpp): what route() sends to cuda_tensor_cores for the factored form, bfloat16
// and float16 storage and float with Precision::tf32 (rank <= 256, no weights), rotary positions
// and grouped kv heads included; and the float32 form of a layer with rotary positions or grouped
// kv heads (Precision::fp32, rank <= 128: the SDPA operator's float32 kernel in step 2).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "emflow/capability.hpp"
#include "emflow/factored.hpp"
#include "plan_strategy.hpp"
#include "products_strategy.hpp"
#include "tc_state.hpp"

namespace emflow::detail {

template <class T>
class TcFactoredStrategy final : public PlanStrategy<T> {
 public:
  /// The strategy of `problem` (the update of a factored layer, validated and routed);
  /// `key_splits` as PlanOptions::key_splits (the float kernel's rule, choose_key_splits).
  TcFactoredStrategy(const Problem& problem, int key_splits, const char* operation);

  std::size_t workspace_bytes() const noexcept override { return total_; }
  int key_splits() const noexcept override { return state_.key_splits(); }
  void bind(int device, bool prepare, const char* operation) override;
  void run(const PlanCall<T>& call, unsigned char* workspace, cudaStream_t stream,
           const char* operation) const override;

 private:
  int batch_ = 0, tokens_ = 0, queries_ = 0, dim_ = 0, heads_ = 0, rank_ = 0;
  int kv_heads_ = 0;  // the heads of keys and values (grouped-query heads: fewer than heads_)
  // Where each array lives in the workspace (byte offsets, each aligned).
  std::size_t query_ = 0, key_ = 0, value_ = 0, bias_ = 0, total_ = 0;
  TcAttentionState state_;  // the head outputs and the key splits' states
  bool key_bias_ = false;
  bool float32_ = false;  // float products: the float32 kernel instead of the tensor cores
};

extern template class TcFactoredStrategy<bfloat16>;
extern template class TcFactoredStrategy<float16>;
extern template class TcFactoredStrategy<float>;

}  // namespace emflow::detail
