// emflow: standard multi-head attention, and its exact conversion to an EMF layer
// (docs/MATH.md §3).
//
// Multi-head attention with H heads on a model dimension d, per head h:
//   q = W_Q,h x + b_Q,h,  k = W_K,h x + b_K,h,  v = W_V,h x + b_V,h
//   o_h(i) = sum_j softmax_j(q_i . k_j / sqrt(d_k)) v_j
//   out_i  = sum_h W_O,h o_h(i) + b_O
// The same update written as an EMF layer (beta = 1):
//   M_h = W_Q,h^T W_K,h / sqrt(d_k)     u_h = W_K,h^T b_Q,h / sqrt(d_k)
//   F_h = W_O,h W_V,h                   c   = sum_h W_O,h b_V,h + b_O
// The key bias b_K drops out: q_i . b_K depends on the query only and cancels in the softmax.
//
// Everything here is double precision on host tensors, validates its input and throws
// emflow::Error (ErrorCode::invalid_argument) naming the offending argument with its expected
// and actual shape. All calls block.
#pragma once

#include <cstdint>
#include <vector>

#include "emflow/reference.hpp"
#include "emflow/tensor.hpp"
#include "emflow/types.hpp"

namespace emflow {

/// The weights of one multi-head attention sub-layer, heads stacked along the rows of the
/// projections (head h owns rows h*d_k .. (h+1)*d_k - 1 of W_Q and W_K, rows h*d_v .. of W_V,
/// and columns h*d_v .. (h+1)*d_v - 1 of W_O), as PyTorch's nn.MultiheadAttention stores them.
/// A bias left default constructed (absent) counts as zero.
struct MultiHeadAttentionWeights {
  std::int64_t heads = 1;      ///< H >= 1
  std::int64_t model_dim = 0;  ///< d >= 1, the token dimension
  std::int64_t head_dim = 0;   ///< d_k >= 1, the query/key dimension of one head
  std::int64_t value_dim = 0;  ///< d_v >= 1, the value dimension of one head
  Tensor<double> query;        ///< W_Q: (H*d_k, d)
  Tensor<double> key;          ///< W_K: (H*d_k, d)
  Tensor<double> value;        ///< W_V: (H*d_v, d)
  Tensor<double> output;       ///< W_O: (d, H*d_v)
  Tensor<double> query_bias;   ///< b_Q: (H*d_k), optional
  Tensor<double> key_bias;     ///< b_K: (H*d_k), optional
  Tensor<double> value_bias;   ///< b_V: (H*d_v), optional
  Tensor<double> output_bias;  ///< b_O: (d), optional
};

/// Checks sizes and the shape of every weight; throws emflow::Error naming the first offender.
void validate(const MultiHeadAttentionWeights& weights, const char* operation = "mha");

/// The EMF layer equal to `weights` (docs/MATH.md §3): M (H, d, d), F (H, d, d), u (H, d) and
/// c (d), always present (zero where the biases are absent). With beta = 1,
/// reference::attend(X, to_emf(w)).update equals mha_reference(w, X) up to rounding.
reference::Layer to_emf(const MultiHeadAttentionWeights& weights);

/// Plain multi-head attention, computed the usual way (project to q, k, v per head, softmax of
/// q . k / sqrt(d_k), weighted values, output projection), in double.
/// cloud: (N, d) or (B, N, d); mask and key_lengths as for reference::scores. Returns the
/// sub-layer's output (without the residual), the cloud's shape. A query that sees no key gets
/// 0 (not b_O), the EMF convention of docs/MATH.md §1, so the two forms agree everywhere.
Tensor<double> mha_reference(const MultiHeadAttentionWeights& weights, const Tensor<double>& cloud,
                             const Mask& mask = {},
                             const std::vector<std::int64_t>& key_lengths = {});

}  // namespace emflow
