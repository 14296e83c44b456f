// The float32 and float64 product paths of cuda::AttentionPlan (plan_strategy.hpp): cuBLAS
// projects the queries and the contents, then either the fused kernel (route() kernel cuda_fused,
// float only: online softmax, with or without key splits) or the unfused chain (cuda_unfused:
// cuBLAS scores, a masked row softmax, cuBLAS updates). It computes the update (AttentionOutput)
// or the partial state over its keys (PartialOutput, partial.hpp). Nq below is query_tokens with
// queries, else tokens.
//
// Workspace (each region aligned to 256 bytes, in this order):
//   relevance  (heads, batch * Nq, dim)     Q_h = scale (Y M_h + 1 u_h^T) for the queries Y (X
//              for self-attention); scale = beta for the unfused path and beta log2(e) for the
//              fused one (its softmax is in base 2)
//   content    (heads, batch * tokens, dim)  C_h = X F_h^T
//   scores     (batch, heads, Nq, tokens)   unfused only, when `weights` is not requested
//   partial    (heads, batch, Nq, dim)      fused update without key splits, when heads > 1
//              (per-head updates, summed in head order by sum_heads_kernel: deterministic)
//   split rows (splits, batch, heads, Nq, dim), split lse and split entropy (splits, batch,
//              heads, Nq): fused with key splits (the partial state of each split, merged in
//              split order by merge_splits_kernel: deterministic)
//   cublas     cuBLAS's own scratch (cublasSetWorkspace)
//
// Key splits (flash-decoding): a cross-attention whose fused grid would be small (few query
// blocks: decoding) splits the keys into blocks of a multiple of 64 keys, processed by blocks of
// their own. The choice depends on the shapes alone (not on the device), so the workspace size
// needs no device and results are the same on every device.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "emflow/attention.hpp"
#include "emflow/capability.hpp"
#include "plan_strategy.hpp"

namespace emflow::detail {

struct CublasApi;
struct KernelMask;

/// The key splits of the fused kernel: `splits` blocks of `keys` keys (the last may be shorter).
struct KeySplits {
  int splits = 1;
  int keys = 0;
};

/// The automatic choice (see above) for these shapes; `requested` > 0 asks for that many splits
/// instead (clamped to one per 64-key tile, and so that the grid stays within 2^31 - 1 blocks),
/// 1 for none.
KeySplits choose_key_splits(std::int64_t batch, std::int64_t heads, std::int64_t queries,
                            std::int64_t tokens, bool cross, int requested = 0);

template <class T>
class ProductsStrategy final : public PlanStrategy<T> {
 public:
  /// The strategy of `problem` (an update or a partial state of the dense form, validated) on
  /// `kernel` (cuda_fused or cuda_unfused); `key_splits` as PlanOptions::key_splits.
  ProductsStrategy(const Problem& problem, Kernel kernel, int key_splits, const char* operation);

  std::size_t workspace_bytes() const noexcept override { return total_; }
  int key_splits() const noexcept override { return splits_.splits; }
  void bind(int device, bool prepare, const char* operation) override;
  void run(const PlanCall<T>& call, unsigned char* workspace, cudaStream_t stream,
           const char* operation) const override;

 private:
  // What a launch writes: the update (with optional lse, entropy, weights) or a partial state.
  struct Targets {
    T* update = nullptr;
    T* heads = nullptr;
    T* lse = nullptr;
    T* entropy = nullptr;
    T* weights = nullptr;
  };
  void launch_fused(const AttentionInput<T>& input, const Targets& targets, const T* relevance,
                    const T* content, unsigned char* workspace, const KernelMask& mask,
                    cudaStream_t stream, const char* operation) const;

  std::int64_t batch_ = 0, tokens_ = 0, queries_ = 0, dim_ = 0, heads_ = 0;
  bool partial_ = false;
  bool fused_ = false;
  KeySplits splits_;
  // Byte offsets of the workspace regions (see above) and the total size.
  std::size_t relevance_ = 0, content_ = 0, scores_ = 0, heads_out_ = 0;
  std::size_t split_rows_ = 0, split_lse_ = 0, split_entropy_ = 0, cublas_region_ = 0;
  std::size_t total_ = 0;
  int device_ = -1;
  const CublasApi* cublas_ = nullptr;  // loaded when the plan is prepared
};

extern template class ProductsStrategy<float>;
extern template class ProductsStrategy<double>;

}  // namespace emflow::detail
