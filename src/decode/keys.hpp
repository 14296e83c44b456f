// The keys and contents of a growing cloud for one layer, in either form, held in T and computed
// in double (BasicDecodeCache, include/emflow/decode.hpp, for double and for the factored form).
//
// Per head the store keeps what a later query needs of each token: its key k_j (the token itself
// in the dense form, shared by every head; B_h x_j in the factored form), the key bias term
// u_h^T x_j (factored form only: in the dense form the bias acts through the query), and its
// value (F_h x_j dense, V_h x_j factored). A query is projected once per head (p = M_h^T q + u_h
// dense, A_h q factored), scored against the keys it sees, and its weighted value mapped back to
// the cloud's space (U_h in the factored form).
#pragma once

#include <cstdint>
#include <vector>

#include "core/queries.hpp"
#include "emflow/attention.hpp"
#include "emflow/factored.hpp"

namespace emflow::detail::decode {

template <class T>
class KeyStore {
 public:
  KeyStore(const LayerOperators<T>& layer, std::int64_t dim, double beta);
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
  struct Head {
    std::vector<T> keys;    // N x width (factored form only; the dense form reads tokens_)
    std::vector<T> bias;    // N (factored form with a key bias)
    std::vector<T> values;  // N x width
  };
  void project_query(const T* q, std::int64_t h, double* p) const;
  const T* head_keys(std::int64_t h) const;

  bool factored_ = false;
  std::int64_t dim_ = 0, heads_ = 0, width_ = 0, size_ = 0;  // width: d dense, r factored
  double beta_ = 1.0;
  // Dense: relevance M (H d d), content F (H d d). Factored: A (H r d), B (H r d), U (H d r),
  // V (H r d). key_bias u (H d) and offset c (d) in both, empty when absent.
  std::vector<T> query_map_, key_map_, up_map_, value_map_, key_bias_, offset_;
  std::vector<T> tokens_;  // dense form: N x d, the keys of every head
  std::vector<Head> per_head_;
};

extern template class KeyStore<float>;
extern template class KeyStore<double>;

}  // namespace emflow::detail::decode
