// emflow: the backward pass of an attention layer (docs/MATH.md §8.4, §8.5), the gradients of a
// loss with respect to everything emflow::attend and emflow::attend_factored read: the cloud, the
// queries of cross-attention, the operators, the key bias, the offset and beta, from the upstream
// gradients of the update, the lse and the entropy (include/emflow/sdpa.hpp's
// UpstreamGradients: each optional).
//
// Each head of a layer is the SDPA-shaped operator between projections (docs/MATH.md §8.1):
//   dense     queries M_h^T q_i + u_h, keys x_j, values F_h x_j, scale beta, o^h_i summed;
//   factored  queries (A_h q_i, 1), keys (B_h x_j, u_h^T x_j), values V_h x_j, scale beta,
//             U_h o^h_i summed;
// so the backward pass projects the cloud, runs the SDPA-shaped backward of every head (on
// Device::cpu the fused kernel of sdpa.hpp) and applies the chain rule through the projections
// as batched products. The heads' own averages o^h_i (which the update sums) enter D_i and dU_h,
// so the forward pass of each head is recomputed: these calls read nothing saved from the
// forward pass, only its inputs. X is query, key and content at once in self-attention, so dX
// sums three parts; in cross-attention the queries' cloud gets the query part.
//
// Which rows take part (docs/MATH.md §8.6): a query that sees at least one key, a key that such a
// query sees. Every other row of dX and dQ is exactly zero, and neither it nor its upstream
// gradients are read (padding may hold anything, also NaN); no term is computed for an absent
// upstream gradient. Non-finite values reach what §8.6 says: a float call with a NaN or infinity
// in a value that a row taking part reads is computed by the double reference.
//
// Precision: float is computed in float32 on Device::cpu (the fused engine and its micro-kernel;
// bitwise the same for any thread count), double by the double reference (on Device::cpu too),
// and Device::reference computes either in double and rounds the gradients to T once.
// Device::automatic is Device::cpu (no GPU path computes the backward pass yet); Device::cuda is
// ErrorCode::unsupported. Errors: emflow::Error naming the argument, as emflow::attend.
#pragma once

#include <cstdint>

#include "emflow/attention.hpp"
#include "emflow/factored.hpp"
#include "emflow/sdpa.hpp"

namespace emflow {

/// Where the backward pass of a dense layer writes. Every pointer is optional (null: that
/// gradient is not returned); each has the shape of its argument in AttentionInput.
template <class T>
struct LayerGradientOutput {
  T* cloud = nullptr;      ///< dX (batch, tokens, dim): the key and content parts, and for
                           ///< self-attention the query part
  T* queries = nullptr;    ///< dQ (batch, query_tokens, dim); cross-attention only
  T* relevance = nullptr;  ///< dM (heads, dim, dim)
  T* content = nullptr;    ///< dF (heads, dim, dim)
  T* key_bias = nullptr;   ///< du (heads, dim); only for a layer with a key bias
  T* offset = nullptr;     ///< dc (dim): the sum of dDelta over the queries that see a key; only
                           ///< for a layer with an offset
  double* beta = nullptr;  ///< dL/dbeta
};

/// The backward pass of emflow::attend (docs/MATH.md §8.4) for the layer and clouds of `input`:
///   dM_h = Q^T dR_h,  du_h = sum_i dR_h,i,  dF_h = dC_h^T X,
///   dQ = sum_h dR_h M_h^T,  dX = (dQ for self-attention) + sum_h (dK_h + dC_h F_h),
///   dc = sum of dDelta over the queries that see a key,  dbeta = dscale,
/// with dR_h, dK_h, dC_h the SDPA-shaped gradients of head h (Q the query rows). upstream: dDelta
/// (the update's shape), dlse and dH (batch, heads, query_tokens), each optional.
template <class T>
void attend_backward(const AttentionInput<T>& input, const UpstreamGradients<T>& upstream,
                     const LayerGradientOutput<T>& gradients, const ExecutionOptions& options = {});

/// Where the backward pass of a factored layer writes; every pointer optional, as above.
template <class T>
struct FactoredGradientOutput {
  T* cloud = nullptr;         ///< dX (batch, tokens, dim)
  T* queries = nullptr;       ///< dQ (batch, query_tokens, dim); cross-attention only
  T* query_factor = nullptr;  ///< dA (heads, rank, dim)
  T* key_factor = nullptr;    ///< dB (heads, rank, dim)
  T* content_up = nullptr;    ///< dU (heads, dim, rank)
  T* content_down = nullptr;  ///< dV (heads, rank, dim)
  T* key_bias = nullptr;      ///< du (heads, dim); only for a layer with a key bias
  T* offset = nullptr;        ///< dc (dim); only for a layer with an offset
  double* beta = nullptr;     ///< dL/dbeta
};

/// The backward pass of emflow::attend_factored (docs/MATH.md §8.5), input.layer left empty as
/// there:
///   dA_h = dQ_h^T Q,  dB_h = dK_h^T X,  dV_h = dY_h^T X,  du_h = X^T dw_h,  dU_h = dDelta^T O_h,
///   dQ = sum_h dQ_h A_h,  dX = (dQ for self-attention) + sum_h (dK_h B_h + dY_h V_h + dw_h u_h^T),
/// with dQ_h, (dK_h, dw_h), dY_h the SDPA-shaped gradients of head h from dO_h = dDelta U_h, and
/// O_h its averages; dc and dbeta as for the dense form.
template <class T>
void attend_factored_backward(const AttentionInput<T>& input, const FactoredLayer<T>& layer,
                              const UpstreamGradients<T>& upstream,
                              const FactoredGradientOutput<T>& gradients,
                              const ExecutionOptions& options = {});

#define EMFLOW_BACKWARD_EXTERN(T)                                                                  \
  extern template void attend_backward<T>(const AttentionInput<T>&, const UpstreamGradients<T>&,   \
                                          const LayerGradientOutput<T>&, const ExecutionOptions&); \
  extern template void attend_factored_backward<T>(                                                \
      const AttentionInput<T>&, const FactoredLayer<T>&, const UpstreamGradients<T>&,              \
      const FactoredGradientOutput<T>&, const ExecutionOptions&);
EMFLOW_BACKWARD_EXTERN(float)
EMFLOW_BACKWARD_EXTERN(double)
#undef EMFLOW_BACKWARD_EXTERN

}  // namespace emflow
