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
// The backward pass (docs/MATH.md §8, src/reference/backward.cpp): the SDPA-shaped operator
// O = softmax(scale Q K^T) V with its lse and entropy (sdpa_attend) and its gradients dQ, dK, dV
// (sdpa_backward), and the gradients of the dense layer (attend_backward: dX, dM, dF, du, dc,
// d beta) and of the factored layer (attend_factored_backward: dX, dA, dB, dU, dV, du, dc,
// d beta), each from upstream gradients of the update, lse and entropy, any of them absent.
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
#include "emflow/factored.hpp"
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

// ---------------------------------------------------------------------------------------------
// The backward pass (docs/MATH.md §8). Every function below recomputes the forward pass in
// double, holds O(N^2) values per head, and follows the rules of §8.6: masked pairs and padding
// contribute nothing, a query that sees no key gets an exactly zero gradient (never NaN) and its
// upstream gradients are not read, and rows that take no part in the forward pass are not read.
// Non-finite values propagate as §8.6 states; nothing is tested for NaN.

/// Which keys each query sees, for the functions below (docs/MATH.md §1.6): the fields of the
/// same names in emflow::AttentionInput, with the same meaning and the same rule
/// (Mask::visible_keys_at through the rule of emflow::attend).
struct Visibility {
  Mask mask;
  /// Lk_b in [0, Nk] per cloud (B entries), or empty: every key is real.
  std::vector<std::int64_t> key_lengths;
  /// Lq_b in [0, Nq] per cloud, or empty: for the SDPA-shaped operator and for cross-attention
  /// every query is real; for self-attention (no queries given) the key lengths.
  std::vector<std::int64_t> query_lengths;
  /// Sequence position of key 0.
  std::int64_t key_position = 0;
  /// Sequence position of query 0, or kAlignToEnd: key_position + Lk_b - Lq_b (bottom-right).
  std::int64_t query_position = kAlignToEnd;
  /// Per-cloud positions of query 0 (B entries) overriding query_position, or empty.
  std::vector<std::int64_t> query_positions;
};

/// Gradients of a scalar loss with respect to the outputs of a forward pass: its "upstream"
/// gradients. Each is absent (`Tensor<double>{}`: the loss does not depend on that output, and
/// no term of it is computed) or has the exact shape of the output.
struct OutputGradients {
  Tensor<double> update;   ///< dO (B, Hq, Nq, rv) for the SDPA shape; dDelta (the update's shape)
  Tensor<double> lse;      ///< dlse: (B, H, Nq)
  Tensor<double> entropy;  ///< dH: (B, H, Nq)
};

/// The forward pass of the SDPA-shaped operator.
struct SdpaAttention {
  Tensor<double> output;   ///< O: (B, Hq, Nq, rv); 0 for a query with no visible key
  Tensor<double> lse;      ///< (B, Hq, Nq); -inf for a query with no visible key
  Tensor<double> entropy;  ///< (B, Hq, Nq); 0 for a query with no visible key
  Tensor<double> weights;  ///< P: (B, Hq, Nq, Nk) when requested, else absent
};

/// The SDPA-shaped operator (docs/MATH.md §8.1): per cloud b and query head h, with the key and
/// value head g = h / (Hq / Hkv) (grouped heads),
///   s_ij = scale <q_i, k_j> (j visible to i, else -inf),   p_ij = exp(s_ij - lse_i),
///   lse_i = log sum_j exp(s_ij),   H_i = lse_i - sum_j p_ij s_ij,   o_i = sum_j p_ij v_j,
/// with o_i = 0, lse_i = -inf, H_i = 0 for a query that sees no key. It is the inner part of the
/// factored form: with q_i = A_h x_i, k_j = B_h x_j, v_j = V_h x_j and scale = beta, the factored
/// layer's update is sum_h U_h o^h_i + c (tested).
/// queries: Q, (B, Hq, Nq, r); keys: K, (B, Hkv, Nk, r); values: V, (B, Hkv, Nk, rv); Hq a
/// multiple of Hkv; scale: finite (any sign). Non-finite scores follow docs/MATH.md §6.6.
SdpaAttention sdpa_attend(const Tensor<double>& queries, const Tensor<double>& keys,
                          const Tensor<double>& values, double scale,
                          const Visibility& visibility = {}, bool with_weights = false);

/// The gradients of the SDPA-shaped operator.
struct SdpaGradients {
  Tensor<double> queries;  ///< dQ: (B, Hq, Nq, r)
  Tensor<double> keys;     ///< dK: (B, Hkv, Nk, r), summed over the query heads of each group
  Tensor<double> values;   ///< dV: (B, Hkv, Nk, rv), summed likewise
  Tensor<double> scores;   ///< dS = dL/ds_ij: (B, Hq, Nq, Nk), 0 on masked pairs
  double scale = 0.0;      ///< dL/dscale = sum dS_ij <q_i, k_j>
};

/// The backward pass of sdpa_attend (docs/MATH.md §8.2, §8.3), in the FlashAttention-2 form:
///   D_i = <dO_i, O_i>,  dP_ij = <dO_i, v_j>,
///   dS_ij = p_ij (dP_ij - D_i + dlse_i - dH_i (s_ij - lse_i + H_i)),
///   dQ = scale dS K,  dK = scale dS^T Q,  dV = P^T dO,
/// dK and dV summed over the query heads that share a key and value head.
/// queries, keys, values, scale, visibility: as for sdpa_attend. upstream: dO (B, Hq, Nq, rv),
/// dlse and dH (B, Hq, Nq), each absent or of that shape; all absent gives zero gradients.
SdpaGradients sdpa_backward(const Tensor<double>& queries, const Tensor<double>& keys,
                            const Tensor<double>& values, double scale,
                            const Visibility& visibility, const OutputGradients& upstream);
/// The same with the forward pass's statistics read from `saved` instead of recomputed: lse_i,
/// H_i (with dH) and o_i (for D_i, with dO), p_ij = exp(s_ij - lse_i); saved.weights is not read.
/// With `saved` the result of sdpa_attend on the same arguments this equals the function above
/// to rounding. With the statistics of a larger key set of which `keys` are a block (the keys'
/// positions set in `visibility`), it is that block's share: dK and dV of its keys, and the parts
/// of dQ and dscale that sum over the blocks to the whole set's (the sequence-parallel ring's
/// backward, docs/MATH.md §8.9).
SdpaGradients sdpa_backward(const Tensor<double>& queries, const Tensor<double>& keys,
                            const Tensor<double>& values, double scale,
                            const Visibility& visibility, const OutputGradients& upstream,
                            const SdpaAttention& saved);

/// The gradients of a dense layer (docs/MATH.md §8.4); each has the shape of its argument.
struct LayerGradients {
  Tensor<double> cloud;      ///< dX: the query, key and content parts (the key and content
                             ///< parts alone for cross-attention)
  Tensor<double> queries;    ///< dQ for cross-attention; absent for self-attention
  Tensor<double> relevance;  ///< dM
  Tensor<double> content;    ///< dF
  Tensor<double> key_bias;   ///< du; absent when the layer has no key bias
  Tensor<double> offset;     ///< dc; absent when the layer has no offset
  double beta = 0.0;         ///< dL/dbeta
};

/// The backward pass of the dense layer's update (docs/MATH.md §8.4): per head the SDPA-shaped
/// backward with queries M_h^T q_i + u_h, keys x_j, values F_h x_j and scale beta, then the
/// chain rule through those maps: dM_h = Q^T dR_h, du_h = sum_i dr_i, dF_h = dC_h^T X,
/// dQ = sum_h dR_h M_h^T, dX = (dQ for self-attention) + sum_h (dK_h + dC_h F_h),
/// dc = sum of dDelta over the queries that see a key, dbeta = dscale; Q denotes the query rows
/// (X itself for self-attention).
/// cloud: X, (N, d) or (B, N, d). queries: absent for self-attention, else Q with the cloud's
/// rank and B, and its own Nq >= 1. layer, beta: as for attend. upstream: dDelta (the update's
/// shape: the cloud's, or the queries'), dlse and dH (B, H, Nq).
LayerGradients attend_backward(const Tensor<double>& cloud, const Tensor<double>& queries,
                               const Layer& layer, double beta, const Visibility& visibility,
                               const OutputGradients& upstream);

/// The operators of one layer in factored form, in double: what emflow::FactoredLayer points to.
struct FactoredLayer {
  Tensor<double> query_factor;  ///< A: (H, r, d)
  Tensor<double> key_factor;    ///< B: (H, r, d), M_h = A_h^T B_h
  Tensor<double> content_up;    ///< U: (H, d, r)
  Tensor<double> content_down;  ///< V: (H, r, d), F_h = U_h V_h
  Tensor<double> key_bias;      ///< u: (H, d), or absent
  Tensor<double> offset;        ///< c: (d), or absent

  /// Number of heads H and rank r (from query_factor; 0 when it is not (H, r, d)).
  std::int64_t heads() const noexcept;
  std::int64_t rank() const noexcept;
  /// Pointers into this layer for emflow::attend_factored; valid while the layer lives unchanged.
  emflow::FactoredLayer<double> operators() const;
};

/// The gradients of a factored layer (docs/MATH.md §8.5); each has the shape of its argument.
struct FactoredGradients {
  Tensor<double> cloud;         ///< dX (as in LayerGradients)
  Tensor<double> queries;       ///< dQ for cross-attention; absent for self-attention
  Tensor<double> query_factor;  ///< dA
  Tensor<double> key_factor;    ///< dB
  Tensor<double> content_up;    ///< dU
  Tensor<double> content_down;  ///< dV
  Tensor<double> key_bias;      ///< du; absent when the layer has no key bias
  Tensor<double> offset;        ///< dc; absent when the layer has no offset
  double beta = 0.0;            ///< dL/dbeta
};

/// The backward pass of the factored layer's update (docs/MATH.md §8.5): per head the
/// SDPA-shaped backward with queries (A_h q_i, 1), keys (B_h x_j, u_h^T x_j) (the key bias as one
/// more coordinate; without it A_h q_i and B_h x_j), values V_h x_j and scale beta, from
/// dO^h_i = U_h^T dDelta_i; then dA_h = dQ_h^T Q, dB_h = dK_h^T X, dV_h = dY_h^T X,
/// du_h = X^T dw_h, dU_h = dDelta^T O_h, dQ = sum_h dQ_h A_h,
/// dX = (dQ for self-attention) + sum_h (dK_h B_h + dY_h V_h + dw_h u_h^T), dc and dbeta as for
/// the dense form (Q the query rows, as there). Arguments as for attend_backward, with `layer`
/// in place of the dense operators.
FactoredGradients attend_factored_backward(const Tensor<double>& cloud,
                                           const Tensor<double>& queries,
                                           const FactoredLayer& layer, double beta,
                                           const Visibility& visibility,
                                           const OutputGradients& upstream);

}  // namespace emflow::reference
