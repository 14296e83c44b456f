// emflow: the SDPA-shaped operator and its backward pass (docs/MATH.md §8.1 to §8.3), the shape
// of PyTorch's scaled_dot_product_attention: queries, keys and values already projected.
//
// For each cloud b, query head h and query i, with the key and value head g = h / (Hq / Hkv)
// (grouped heads; Hq = Hkv is plain multi-head attention, Hkv = 1 multi-query attention):
//
//   s_ij = scale <q_i, k_j>          (j visible to i; the other keys take no part)
//   lse_i = log sum_j exp(s_ij),     p_ij = exp(s_ij - lse_i)
//   H_i = lse_i - sum_j p_ij s_ij    (attention entropy, nats)
//   o_i = sum_j p_ij v_j             (o_i = 0, lse_i = -inf, H_i = 0 for a query that sees no key)
//
// Both forms of an EMF layer are this operator between projections (docs/MATH.md §8.1): the
// factored layer with q_i = A_h x_i, k_j = B_h x_j, v_j = V_h x_j and scale = beta is exactly it,
// its update sum_h U_h o^h_i + c.
//
// Which keys a query sees is the rule of emflow::attend for cross-attention (docs/MATH.md §1.6):
// a mask (none, causal, sliding window) on sequence positions, per-cloud key lengths Lk_b (keys
// j >= Lk_b are padding) and query lengths Lq_b (queries i >= Lq_b are padding and see no key),
// key j at key_position + j and query i at query_position + i, by default (kAlignToEnd) aligned
// bottom-right: query i at key_position + Lk_b - Lq_b + i. PyTorch's is_causal aligns top-left:
// query_position = 0. Every query is real unless query lengths are given.
//
// The backward pass (sdpa_backward) computes dQ, dK, dV and dscale from the upstream gradients
// of the output, the lse and the entropy (each optional), keeping only lse (and O, and H when the
// entropy's gradient is given) from the forward pass: the N x N weights are recomputed, never
// stored (FlashAttention-2's algorithm, docs/MATH.md §8.3).
//
// All arrays are dense and row-major host arrays (cuda.hpp's sdpa_attend_async and
// sdpa_backward_async take device arrays and a stream, computing what Device::cuda does below).
// Errors: every call validates its arguments first and throws emflow::Error
// (ErrorCode::invalid_argument) naming the argument, the expected and the actual value, e.g.
// `sdpa_attend: argument 'query_heads' must be a multiple of kv_heads (4), got 6`;
// ErrorCode::unsupported for a device that does not implement the call (Device::cuda for what its
// kernels do not compute, below), ErrorCode::out_of_memory when working memory cannot be allocated.
//
// Precision (docs/MATH.md §7, §8.6): T is float, double, emflow::bfloat16 or emflow::float16.
//   Device::cpu, float: the fused float32 engine (src/cpu): float products and sums, online
//     softmax in the forward, the FlashAttention-2 backward with dQ accumulated in float32.
//     Bitwise the same results for any thread count.
//   Device::cpu, bfloat16 and float16: the stored values widened exactly to float, the float
//     path above, the output and the gradients rounded to T once; lse, entropy and their
//     upstream gradients are float32 (Stat<T>). The bfloat16 backward on a processor with
//     AVX512-BF16 runs its five products on vdpbf16ps instead (float32 accumulation), with the
//     weights P and score gradients dS rounded to bfloat16 before the products that read them,
//     as FlashAttention does in 16 bits: held to the 2x-naive rule (docs/MATH.md §8.8).
//   Device::cpu, double, and Device::reference: the double-precision reference
//     (reference::sdpa_attend, reference::sdpa_backward), the results rounded to T once. The
//     reference holds the N x N weights and score gradients of one call (O(B Hq Nq Nk) doubles).
//   Device::cuda, the forward pass: float with Precision::fp32 on a float32 kernel
//     (kernels/sdpa_backward.cu: float products and sums, an online softmax; rank and
//     value_rank <= 128, else unsupported naming the limit); bfloat16, float16 and float with
//     Precision::tf32 on the tensor-core attention kernel (kernels/tc_attention.cu) on the
//     arrays as they are, bfloat16 or float16 products (TF32 for float) accumulated in float32,
//     the output rounded to T once, lse and entropy float32; value_rank equal to rank,
//     rank <= 256 (else unsupported, naming the limit). Host arrays:
//     copied to the device and back, the call returns when the results are on the host. Held to
//     the 2x-naive rule of the tensor cores (docs/MATH.md §7.4).
//   Device::cuda, the backward pass (kernels/sdpa_backward.cu: the weights recomputed from lse,
//     dK and dV per key tile, dQ per query tile, no atomics, the same bits run to run): float32
//     kernels for float; for bfloat16 and float16 the tensor cores (the five products in the
//     storage type's products with float32 accumulation, P and dS rounded to T before the
//     products that read them, as the cpu's bfloat16 path and FlashAttention do), the gradients
//     rounded to T once; rank and value_rank <= 128; float64 unsupported. Host arrays, copied
//     both ways.
//   Device::automatic: the GPU where a GPU is present and it computes the call, else
//     Device::cpu.
// Non-finite values (docs/MATH.md §6.6, §8.6): a float or 16-bit call on Device::cpu or cuda with
// a NaN or infinity in a value it reads (a real query row, a real key or value row, an upstream
// gradient or saved statistic of a query that sees a key) is computed by the double reference,
// which puts NaN exactly where §8.6 says; padding rows and queries without keys are never read
// and may hold anything.
#pragma once

#include <cstdint>

#include "emflow/attention.hpp"
#include "emflow/precision.hpp"
#include "emflow/types.hpp"

namespace emflow {

/// Everything the SDPA-shaped operator reads.
template <class T>
struct SdpaInput {
  const T* queries = nullptr;     ///< Q: (batch, query_heads, query_tokens, rank). Required.
  const T* keys = nullptr;        ///< K: (batch, kv_heads, tokens, rank). Required.
  const T* values = nullptr;      ///< V: (batch, kv_heads, tokens, value_rank). Required.
  std::int64_t batch = 1;         ///< B >= 1
  std::int64_t query_heads = 1;   ///< Hq >= 1, a multiple of kv_heads
  std::int64_t kv_heads = 1;      ///< Hkv >= 1
  std::int64_t query_tokens = 0;  ///< Nq >= 1
  std::int64_t tokens = 0;        ///< Nk >= 1, the keys
  std::int64_t rank = 0;          ///< r >= 1, the width of queries and keys
  std::int64_t value_rank = 0;    ///< rv >= 1, the width of values and outputs
  /// Multiplies every score; finite (any sign), and |scale| <= 2^64 for float and 16-bit input
  /// (as beta, docs/MATH.md §6.6). PyTorch's default is 1 / sqrt(rank).
  double scale = 1.0;
  Mask mask;
  /// Optional per-cloud key lengths Lk_b in [0, tokens] (`batch` entries).
  const std::int64_t* key_lengths = nullptr;
  /// Optional per-cloud query lengths Lq_b in [0, query_tokens] (`batch` entries); null: every
  /// query is real.
  const std::int64_t* query_lengths = nullptr;
  /// Sequence position of key 0.
  std::int64_t key_position = 0;
  /// Sequence position of query 0, or kAlignToEnd (bottom-right, the default).
  std::int64_t query_position = kAlignToEnd;
  /// Optional per-cloud positions of query 0 (`batch` entries), overriding query_position.
  const std::int64_t* query_positions = nullptr;
};

/// Where the forward pass writes. Only `output` is required.
template <class T>
struct SdpaOutput {
  T* output = nullptr;         ///< O: (batch, query_heads, query_tokens, value_rank)
  Stat<T>* lse = nullptr;      ///< (batch, query_heads, query_tokens); -inf without keys
  Stat<T>* entropy = nullptr;  ///< (batch, query_heads, query_tokens); 0 without keys
};

/// The forward pass: O, lse and entropy of `input` (see the top of this file).
template <class T>
void sdpa_attend(const SdpaInput<T>& input, const SdpaOutput<T>& output,
                 const ExecutionOptions& options = {});

/// What the backward pass reads of the forward pass: the outputs sdpa_attend returned for the
/// same input (on any device). Device::cpu, cuda and automatic read them and do not recompute
/// them (Device::reference recomputes them in double from the stored inputs: the oracle), so a
/// call over a block of the keys (key_position where the block starts) with the statistics of
/// the whole key set gives that block's share of the gradients: dK and dV of its keys, and parts
/// of dQ and dscale that sum over the blocks (docs/MATH.md §8.9; the ring's backward,
/// sequence_parallel.hpp).
template <class T>
struct SdpaSaved {
  const T* output = nullptr;         ///< O; required when the output's gradient is given
  const Stat<T>* lse = nullptr;      ///< lse; required
  const Stat<T>* entropy = nullptr;  ///< H; required when the entropy's gradient is given
};

/// The gradients of a loss with respect to the outputs of a forward pass (its "upstream"
/// gradients). Each is optional: null means the loss does not depend on that output, and no
/// term of it is computed. The rows of queries that see no key are never read.
template <class T>
struct UpstreamGradients {
  const T* update = nullptr;         ///< dO (the output's shape) or dDelta (the update's shape)
  const Stat<T>* lse = nullptr;      ///< dlse: (batch, heads, query_tokens)
  const Stat<T>* entropy = nullptr;  ///< dH: (batch, heads, query_tokens)
};

/// Where the backward pass of the SDPA-shaped operator writes. dQ, dK and dV are required.
template <class T>
struct SdpaGradientOutput {
  T* queries = nullptr;     ///< dQ: Q's shape; exactly 0 on the rows of queries without keys
  T* keys = nullptr;        ///< dK: K's shape, summed over the query heads of each group
  T* values = nullptr;      ///< dV: V's shape, summed likewise; 0 on keys that no query sees
  double* scale = nullptr;  ///< dL/dscale = sum dS_ij <q_i, k_j>, optional
};

/// The backward pass of sdpa_attend (docs/MATH.md §8.2, §8.3):
///   D_i = <dO_i, O_i>,   dP_ij = <dO_i, v_j>,
///   dS_ij = p_ij (dP_ij - D_i + dlse_i - dH_i (s_ij - lse_i + H_i)),
///   dQ = scale dS K,   dK = scale dS^T Q,   dV = P^T dO,
/// dK and dV summed over the query heads that share a key and value head. With every upstream
/// gradient absent the gradients are zero. The memory used beyond the arguments is O((Nq + Nk)
/// (r + rv)) per head in flight on Device::cpu (the reference's: see the top of this file).
template <class T>
void sdpa_backward(const SdpaInput<T>& input, const SdpaSaved<T>& saved,
                   const UpstreamGradients<T>& upstream, const SdpaGradientOutput<T>& gradients,
                   const ExecutionOptions& options = {});

#define EMFLOW_SDPA_EXTERN(T)                                                                      \
  extern template void sdpa_attend<T>(const SdpaInput<T>&, const SdpaOutput<T>&,                   \
                                      const ExecutionOptions&);                                    \
  extern template void sdpa_backward<T>(const SdpaInput<T>&, const SdpaSaved<T>&,                  \
                                        const UpstreamGradients<T>&, const SdpaGradientOutput<T>&, \
                                        const ExecutionOptions&);
EMFLOW_SDPA_EXTERN(float)
EMFLOW_SDPA_EXTERN(double)
EMFLOW_SDPA_EXTERN(bfloat16)
EMFLOW_SDPA_EXTERN(float16)
#undef EMFLOW_SDPA_EXTERN

}  // namespace emflow
