// What the dense (tc_dense.cpp) and factored (tc_factored.cpp) tensor-core strategies share: the
// kernel type of a storage type, and the float32 state of the attention in the plan's workspace
// (the per-head outputs, lse and entropy the combine reads, and the key splits' partial states
// before their merge), with the attention's arguments over it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "emflow/attention.hpp"
#include "emflow/capability.hpp"
#include "emflow/precision.hpp"
#include "kernels/tc_attention.hpp"
#include "kernels/tc_projection.hpp"
#include "plan_strategy.hpp"
#include "products_strategy.hpp"

namespace emflow::detail {

/// The tensor-core kernel of storage T: float runs on TF32 products.
template <class T>
constexpr TcType tc_type() {
  return std::is_same_v<T, float>      ? TcType::tf32
         : std::is_same_v<T, bfloat16> ? TcType::bf16
                                       : TcType::f16;
}

/// The attention's float32 state for the heads and clouds of one problem at width `width` (d for
/// the dense form, the rank for the factored one), whatever the storage type.
class TcAttentionState {
 public:
  /// Takes the state's regions from `at`: head outputs (heads, batch, queries, width), lse,
  /// entropy when the problem asks for it, and with key splits (the float kernel's rule,
  /// choose_key_splits; `key_splits` as PlanOptions::key_splits) each split's partial state.
  void take(WorkspaceCursor& at, const Problem& p, std::int64_t width, int key_splits) {
    const std::int64_t H = p.heads, B = p.batch, Nq = p.query_tokens;
    heads_ = static_cast<int>(H);
    batch_ = static_cast<int>(B);
    queries_ = static_cast<int>(Nq);
    tokens_ = static_cast<int>(p.tokens);
    width_ = static_cast<int>(width);
    entropy_out_ = p.entropy;
    heads_out_ = at.take(H * B * Nq * width, sizeof(float), "head outputs");
    lse_ = at.take(H * B * Nq, sizeof(float), "lse");
    entropy_ = at.take(entropy_out_ ? H * B * Nq : 0, sizeof(float), "entropy");
    splits_ = choose_key_splits(B, H, Nq, p.tokens, p.cross, key_splits);
    if (splits_.splits > 1) {
      const std::int64_t S = splits_.splits;
      split_rows_ = at.take(S * H * B * Nq * width, sizeof(float), "split rows");
      split_lse_ = at.take(S * H * B * Nq, sizeof(float), "split lse");
      split_entropy_ = at.take(S * H * B * Nq, sizeof(float), "split entropy");
    }
  }

  int key_splits() const noexcept { return splits_.splits; }

  /// The attention's arguments over this state in the workspace at `base`, for queries, keys and
  /// values of kernel type `type` (keys per head, or the cloud itself for every head:
  /// shared_keys), key bias terms or null, scale beta log2(e), and the mask of `input`.
  template <class T>
  TcAttentionArgs args(unsigned char* base, const AttentionInput<T>& input, const void* query,
                       const void* key, bool shared_keys, const void* value,
                       const float* key_bias) const {
    TcAttentionArgs args;
    args.type = tc_type<T>();
    args.query = query;
    args.key = key;
    args.shared_keys = shared_keys;
    args.value = value;
    args.key_bias = key_bias;
    args.scale = static_cast<float>(input.beta * 1.4426950408889634);
    args.out = region(base, heads_out_);
    args.lse = region(base, lse_);
    args.entropy = entropy_out_ ? region(base, entropy_) : nullptr;
    args.batch = batch_;
    args.heads = heads_;
    args.tokens = tokens_;
    args.queries = queries_;
    args.dim = width_;
    args.split_keys = splits_.keys;
    args.splits = splits_.splits;
    if (splits_.splits > 1) {
      args.split_out = region(base, split_rows_);
      args.split_lse = region(base, split_lse_);
      args.split_entropy = region(base, split_entropy_);
    }
    args.mask = tc_kernel_mask(input);
    return args;
  }

  /// The combine's arguments over this state: the head outputs of width rank, summed into
  /// updates of width dim (the dense form: rank = dim, the identity for U).
  template <class T>
  TcCombineArgs combine_args(unsigned char* base, const AttentionOutput<T>& output, int dim) const {
    return tc_combine_args(region(base, heads_out_), region(base, lse_),
                           entropy_out_ ? region(base, entropy_) : nullptr, output, heads_, batch_,
                           queries_, dim, width_);
  }

 private:
  static float* region(unsigned char* base, std::size_t offset) {
    return reinterpret_cast<float*>(base + offset);
  }

  int heads_ = 0, batch_ = 0, queries_ = 0, tokens_ = 0, width_ = 0;
  bool entropy_out_ = false;
  // Where each array lives in the workspace (byte offsets, each aligned).
  std::size_t heads_out_ = 0, lse_ = 0, entropy_ = 0;
  // Key splits (one when none) and their partial states before the merge.
  KeySplits splits_;
  std::size_t split_rows_ = 0, split_lse_ = 0, split_entropy_ = 0;
};

}  // namespace emflow::detail
