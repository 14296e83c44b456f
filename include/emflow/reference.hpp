// emflow::reference: every operation of the EMF model (docs/MATH.md §1), one function each, in
// double precision on host tensors, written for clarity rather than speed.
//
// These functions are the ground truth that the fused backends of emflow::attend are measured
// against, and the pieces from which the fused update is composed:
//
//   R       = X M                                   relevance_gradients   (row i is r_{x_i}^T)
//   S       = beta (R X^T + 1 u^T X^T)              scores                (-inf where masked)
//   P, lse, H = softmax_j(S) with log-sum-exp      masked_softmax
//   C       = X F^T                                 content               (row j is (F x_j)^T)
//   Delta   = P C + 1 c^T                           contextual_update     (0 for masked queries)
//   X*      = X + Delta                             residual_update
//
// and `attend`, which sums the update over the heads of a layer exactly as emflow::attend does.
//
// Shapes: a cloud X is (N, d) or a batch (B, N, d), row-major. A function taking a cloud accepts
// either and keeps the caller's rank in its result (scores of a (N, d) cloud are (N, N), of a
// (B, N, d) batch (B, N, N)). An optional tensor argument is absent when it is default
// constructed (`Tensor<double>{}`: rank 0, no elements); any other value must have the exact
// expected shape.
//
// Errors: every function validates its arguments before computing and throws emflow::Error
// (ErrorCode::invalid_argument) whose message names the operation, the argument, and the
// expected and actual shape or value, e.g.
// `relevance_gradients: argument 'relevance' has shape (3, 3), expected (2, 2)`.
//
// All functions block, allocate their results, and are safe to call concurrently.
#pragma once

#include <cstdint>
#include <vector>

#include "emflow/attention.hpp"
#include "emflow/tensor.hpp"
#include "emflow/types.hpp"

namespace emflow::reference {

/// True for a default-constructed tensor: how an optional argument says "not given".
inline bool absent(const Tensor<double>& tensor) noexcept {
  return tensor.rank() == 0 && tensor.size() == 0;
}

/// Relevance gradients R = X M (docs/MATH.md §1): row i is r_{x_i}^T = (M^T x_i)^T, the normal of
/// the leaves {t : <r_{x_i}, t> = const} along which query x_i ranks the tokens.
/// cloud: (N, d) or (B, N, d); relevance: M, (d, d). Returns R with the cloud's shape.
Tensor<double> relevance_gradients(const Tensor<double>& cloud, const Tensor<double>& relevance);

/// Scores s_ij = beta * (<r_i, x_j> + <u, x_j>), i.e. S = beta (R X^T + 1 u^T X^T), set to -inf
/// where key j is not visible to query i (docs/MATH.md §1).
/// relevance_gradients: R, same shape as cloud; cloud: (N, d) or (B, N, d); key_bias: u, (d) or
/// absent; beta: finite; mask: none, causal or window (width >= 1); key_lengths: empty, or one
/// length L_b in [0, N] per cloud (B entries, 1 for an unbatched cloud): keys j >= L_b are
/// hidden from every query and queries i >= L_b (padding) see no key at all.
/// Returns (N, N) or (B, N, N): row i holds query i's scores over the keys j.
Tensor<double> scores(const Tensor<double>& relevance_gradients, const Tensor<double>& cloud,
                      const Tensor<double>& key_bias, double beta, const Mask& mask = {},
                      const std::vector<std::int64_t>& key_lengths = {});

/// The attention weights of each query and their statistics.
struct Softmax {
  Tensor<double> weights;  ///< P, the shape of the scores: p_ij = exp(s_ij - lse_i)
  Tensor<double> lse;      ///< the scores' shape without the last axis: lse_i = m_i + log Z_i
  Tensor<double> entropy;  ///< same shape as lse: H_i = lse_i - sum_j p_ij s_ij (nats)
};

/// Softmax over the last axis of `scores`, each row with its log-sum-exp and entropy
/// (docs/MATH.md §1): m_i = max_j s_ij, Z_i = sum_j exp(s_ij - m_i), lse_i = m_i + log Z_i,
/// p_ij = exp(s_ij - lse_i), H_i = lse_i - sum_j p_ij s_ij. Subtracting m_i keeps every
/// exponent <= 0, so no score is too large to exponentiate.
/// A row whose scores are all -inf (a query with no visible key) gives p_i = 0, lse_i = -inf
/// and H_i = 0; never NaN.
/// scores: rank 1 to 4, with at least one key; entries finite or -inf (NaN and +inf throw).
Softmax masked_softmax(const Tensor<double>& scores);

/// Content C = X F^T (docs/MATH.md §1): row j is (F x_j)^T, what token j contributes.
/// cloud: (N, d) or (B, N, d); content: F, (d, d). Returns C with the cloud's shape.
Tensor<double> content(const Tensor<double>& cloud, const Tensor<double>& content);

/// Contextual update of one head, delta_i = sum_j p_ij C_j + c (docs/MATH.md §1), i.e.
/// Delta = P C + 1 c^T on the queries that see a key. A query whose weight row is all zero (no
/// visible key, as masked_softmax returns it) gets delta_i = 0 and no offset.
/// weights: P, (N, N) or (B, N, N); content: C, (N, d) or (B, N, d) with the same B and N;
/// offset: c, (d) or absent. Returns Delta with the content's shape.
Tensor<double> contextual_update(const Tensor<double>& weights, const Tensor<double>& content,
                                 const Tensor<double>& offset = {});

/// Residual update X* = X + Delta(X) (docs/MATH.md §1). cloud and update: the same shape.
Tensor<double> residual_update(const Tensor<double>& cloud, const Tensor<double>& update);

/// The operators of one layer in double: what emflow::LayerOperators points to.
struct Layer {
  Tensor<double> relevance;  ///< M: (H, d, d), or (d, d) for one head
  Tensor<double> content;    ///< F: the shape of relevance
  Tensor<double> key_bias;   ///< u: (H, d) ((d) for a (d, d) relevance), or absent
  Tensor<double> offset;     ///< c: (d), or absent

  /// Number of heads H (1 for a (d, d) relevance).
  std::int64_t heads() const noexcept { return relevance.rank() == 3 ? relevance.extent(0) : 1; }
  /// Pointers into this layer for emflow::attend; valid while the layer lives unchanged.
  LayerOperators<double> operators() const;
};

/// Everything the multi-head update produces.
struct Attention {
  Tensor<double> update;   ///< Delta: the cloud's shape
  Tensor<double> lse;      ///< (B, H, N); -inf for a query with no visible key
  Tensor<double> entropy;  ///< (B, H, N); 0 for a query with no visible key
  Tensor<double> weights;  ///< (B, H, N, N) when requested, else absent
};

/// The contextual update of a layer of H heads composed from the functions above:
/// delta_i = sum_h sum_j p^h_ij F_h x_j + c (docs/MATH.md §1), with lse and entropy per head.
/// Equals emflow::attend on Device::reference up to rounding (B = 1 for an (N, d) cloud).
/// cloud: (N, d) or (B, N, d); layer: see Layer; beta, mask and key_lengths: as for scores.
Attention attend(const Tensor<double>& cloud, const Layer& layer, double beta = 1.0,
                 const Mask& mask = {}, const std::vector<std::int64_t>& key_lengths = {},
                 bool with_weights = false);

}  // namespace emflow::reference
