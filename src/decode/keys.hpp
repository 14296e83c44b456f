// The keys and contents of a growing cloud for one layer, in either form, held in T and computed
// in double (BasicDecodeCache, include/emflow/decode.hpp, for double and for the factored form);
// in the float factored form, where the engine runs, float32 as the engine computes: the
// projections by detail::cpu_products, each query against its keys (held transposed in panels)
// by detail::cpu_cached_partial; the spans' merge in double.
//
// Per head the store keeps what a later query needs of each token: its key k_j (the token itself
// in the dense form, shared by every head; B_g x_j in the factored form), the key bias term
// u_h^T x_j (factored form only: in the dense form the bias acts through the query), and its
// value (F_h x_j dense, V_g x_j factored). A query is projected once per head (p = M_h^T q + u_h
// dense, A_h q factored), scored against the keys it sees, and its weighted value mapped back to
// the cloud's space (U_h in the factored form).
//
// The factored form holds one set of keys and values per kv head g (FactoredLayer::kv_heads),
// read by the query heads h with h / (heads / kv_heads) = g; the key bias, which belongs to the
// query head, one row per head. With rotary positions each key is rotated once, when it is
// appended, at its position (key j at position j), and each query at its position in attend()
// (docs/MATH.md §2.4): <R(p_i) A_h q, R(p_j) B_g x_j> is the score of attend_factored.
#pragma once

#include <cstdint>
#include <vector>

#include "core/queries.hpp"
#include "core/rotary.hpp"
#include "emflow/attention.hpp"
#include "emflow/factored.hpp"

namespace emflow::detail::decode {

template <class T>
class KeyStore {
 public:
  KeyStore(const LayerOperators<T>& layer, std::int64_t dim, double beta);
  /// The layer validated (kv_heads, rotary); its explicit inverse frequencies are copied.
  KeyStore(const FactoredLayer<T>& layer, std::int64_t dim, double beta);

  std::int64_t size() const { return size_; }
  std::int64_t heads() const { return heads_; }
  bool factored() const { return factored_; }
  const T* offset() const { return offset_.empty() ? nullptr : offset_.data(); }

  /// Appends count validated tokens (count x dim).
  void append(const T* tokens, std::int64_t count);
  void clear();

  /// The update, lse and entropy (heads x count, either may be null) of `count` queries.
  void attend(const T* queries, std::int64_t count, const QueryRule& rule,
              const AttentionOutput<T>& output, int threads) const;

 private:
  struct Set {
    std::vector<T> keys;    // N x width (factored form only; the dense form reads tokens_)
    std::vector<T> values;  // N x width
  };
  /// append in the float factored form by one float32 product (key_value_panels_).
  void append_products(const T* tokens, std::int64_t count);
  /// The updates, lse and entropy of attend in the products() form from the merged states.
  void finish_products(const std::vector<float>& stacked, std::int64_t count,
                       const std::vector<double>& lse, const std::vector<double>& entropy,
                       const AttentionOutput<T>& output, int threads) const;
  /// The projected query of head h at `position` (rotated there in the factored form).
  void project_query(const T* q, std::int64_t h, std::int64_t position, double* p) const;
  /// The set of keys and values that head h reads.
  const Set& set_of(std::int64_t h) const;
  const T* head_keys(std::int64_t h) const;

  bool factored_ = false;
  std::int64_t dim_ = 0, heads_ = 0, width_ = 0, size_ = 0;  // width: d dense, r factored
  std::int64_t sets_ = 0;  // key and value sets: heads (dense), kv_heads (factored)
  double beta_ = 1.0;
  // Dense: relevance M (H d d), content F (H d d). Factored: A (H r d), B (K r d), U (H d r),
  // V (K r d). key_bias u (H d) and offset c (d) in both, empty when absent.
  std::vector<T> query_map_, key_map_, up_map_, value_map_, key_bias_, offset_;
  // The float factored form where the engine runs (products() true), its projections as float32
  // products in the panels of detail::cpu_products: [B_0^T .. B_K-1^T | V_0^T .. V_K-1^T]
  // (d x 2 K r) for append, [A_0^T .. A_H-1^T] (d x H r) for the queries, and
  // [U_0^T ; .. ; U_H-1^T] (H r x d) for the heads' weighted values back in the cloud's space,
  // summed over the heads in the same product. Columns padded to whole vectors.
  bool products() const { return !key_value_panels_.empty(); }
  std::vector<float> key_value_panels_, query_panels_, up_panels_;
  std::int64_t key_value_columns_ = 0, query_columns_ = 0, up_columns_ = 0;
  std::vector<T> tokens_;  // dense form: N x d, the keys of every head
  std::vector<Set> per_set_;
  std::vector<std::vector<T>> bias_;  // factored form with a key bias: per head, N
  RotaryCall rotary_;                 // the factored form's rotation (dim 0: none)
};

extern template class KeyStore<float>;
extern template class KeyStore<double>;

}  // namespace emflow::detail::decode
