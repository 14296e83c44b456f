// Launchers of the SDPA-shaped operator's float32 kernels (sdpa_backward.cu): the backward pass,
// its tensor-core form for 16-bit storage, and the float32 forward pass. Each
// enqueues on `stream`, checks the launch and never synchronises. Pointers are device pointers.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "attention_kernels.hpp"

namespace emflow::detail {

/// The backward pass of O = softmax(scale Q K^T) V (docs/MATH.md §8.2, §8.3), per cloud b,
/// query head h and its key and value head g = h / (heads / kv_heads), with the row terms
/// E_i = <dO_i, O_i> - dlse_i + dH_i (H_i - lse_i) given (zero, with dH_i, on rows that see no
/// key), s_ij = scale <q_i, k_j> and p_ij = exp(s_ij - lse_i) on the visible pairs:
///   dS_ij = p_ij (<dO_i, v_j> - dH_i s_ij - E_i),
///   dQ = scale dS K,   dK = scale dS^T Q,   dV = P^T dO,
/// dK and dV summed over the query heads of each group in head order. Every array is batch-major
/// as the operator's: queries, output gradient and dQ (batch, heads, queries, rank or
/// value_rank), keys, values, dK and dV (batch, kv_heads, tokens, ...), the row arrays (batch,
/// heads, queries). Rows of queries beyond their cloud's query length and keys beyond its key
/// length are read as zeros. No atomics (but with atomic_queries): the same bits run to run.
struct SdpaBackwardArgs {
  const float* query = nullptr;
  const float* key = nullptr;
  const float* value = nullptr;
  const float* output_gradient = nullptr;  ///< dO, zero on rows that see no key
  const float* lse = nullptr;
  const float* row_term = nullptr;          ///< E_i
  const float* entropy_gradient = nullptr;  ///< dH_i, or null (zero)
  float* query_gradient = nullptr;
  float* key_gradient = nullptr;
  float* value_gradient = nullptr;
  /// sum_ij dS_ij <q_i, k_j> per block of queries (batch, heads, query blocks), or null; per
  /// block of keys (batch, kv_heads, key blocks) with atomic_queries.
  float* scale_terms = nullptr;
  /// The atomics mode: the keys kernel also adds each tile's share of dQ to query_gradient
  /// (which the caller zeroes first) by atomicAdd, and the queries kernel is not launched: five
  /// products a tile pair instead of seven, dQ's sums in the order the atomics land (not the
  /// same bits run to run; dK, dV and the scale terms are).
  bool atomic_queries = false;
  float scale = 1.f;
  int batch = 1, heads = 1, kv_heads = 1, queries = 1, tokens = 1, rank = 1, value_rank = 1;
  KernelMask mask;
};

/// The forward pass O = softmax(scale Q K^T) V in float32 (Precision::fp32 on the GPU): per
/// cloud b, query head h and its kv head g = h / (heads / kv_heads), the rows of queries that
/// see a key get o_i, lse_i (base e) and H_i (nats, where entropy is not null); those that see
/// none o_i = 0, lse_i = -inf, H_i = 0. Layouts as SdpaBackwardArgs (batch-major), or with
/// heads_major the factored layer's (tc_factored.cpp): queries, output and the row arrays
/// (heads, batch, queries, ...), keys and values (kv_heads, batch, tokens, ...). value_rank may
/// differ from rank. With key_bias, s_ij = scale (<q_i, k_j> + bias_j), the bias of query head h
/// at (h, b, j) heads-major, (b, h, j) batch-major. FFMA register tiles and an online softmax,
/// one block per 64 queries of one head, the same bits run to run.
struct SdpaForwardArgs {
  const float* query = nullptr;
  const float* key = nullptr;
  const float* value = nullptr;
  const float* key_bias = nullptr;  ///< or null
  float* output = nullptr;
  float* lse = nullptr;      ///< required
  float* entropy = nullptr;  ///< or null
  float scale = 1.f;
  bool heads_major = false;
  int batch = 1, heads = 1, kv_heads = 1, queries = 1, tokens = 1, rank = 1, value_rank = 1;
  KernelMask mask;
};

/// Allows the forward kernel its shared memory (as prepare_sdpa_backward; the same bytes).
void prepare_sdpa_forward(int width, const char* operation);
void launch_sdpa_forward(const SdpaForwardArgs& args, cudaStream_t stream, const char* operation);

/// The widest rank or value_rank of the float32 backward.
constexpr int kSdpaBackwardMaxRank = 128;
/// Queries (and keys) of one tile of the backward.
constexpr int kSdpaBackwardTile = 64;

/// Dynamic shared memory of the backward's kernels at the wider of rank and value_rank (bytes).
std::size_t sdpa_backward_shared_bytes(int width);
/// Allows the backward's kernels their shared memory on the current device (once per device,
/// before their first launch there; not cached: cudaDeviceReset clears it).
void prepare_sdpa_backward(int width, const char* operation);
/// Two launches: dK and dV per key tile, then dQ (and the scale terms) per query tile; with
/// atomic_queries the first alone.
void launch_sdpa_backward(const SdpaBackwardArgs& args, cudaStream_t stream, const char* operation);

/// The tensor-core form of the same two launches for 16-bit storage T (bfloat16, float16): Q, K
/// and V read in T from `query`, `key`, `value` (args.query, key and value are not read), the
/// five products on mma.sync with float32 accumulation, P and dS rounded to T as their A
/// operands; dO, the row arrays and the gradients float32 as above. Shared memory: at most
/// 78 KiB (width 128, with the atomics mode's dS^T tile); prepare_sdpa_backward_tc allows it,
/// as prepare_sdpa_backward.
template <class T>
void prepare_sdpa_backward_tc(int width, const char* operation);
template <class T>
void launch_sdpa_backward_tc(const SdpaBackwardArgs& args, const T* query, const T* key,
                             const T* value, cudaStream_t stream, const char* operation);

/// The row terms of the backward pass on the device: for each row that sees a key,
/// E_i = <dO_i, O_i> - dlse_i + dH_i (H_i - lse_i) summed in double in that order and rounded
/// once, dO_i widened to float, lse_i and dH_i copied; rows that see no key (and padding rows)
/// get zeros, their saved and upstream values never read. T: the storage type of O and dO
/// (float, bfloat16 or float16); the statistics are float32. Shapes as SdpaBackwardArgs.
template <class T>
struct SdpaRowTermsArgs {
  const T* output = nullptr;                ///< O; read with output_gradient
  const T* output_gradient = nullptr;       ///< dO, or null
  const float* lse = nullptr;               ///< saved lse
  const float* entropy = nullptr;           ///< saved H; read with entropy_gradient
  const float* lse_gradient = nullptr;      ///< dlse, or null
  const float* entropy_gradient = nullptr;  ///< dH, or null
  float* output_gradient32 = nullptr;       ///< dO in float (zeros without dO)
  float* lse32 = nullptr;
  float* row_term = nullptr;
  float* entropy_gradient32 = nullptr;  ///< with entropy_gradient
  int batch = 1, heads = 1, queries = 1, tokens = 1, value_rank = 1;
  KernelMask mask;
};
template <class T>
void launch_sdpa_row_terms(const SdpaRowTermsArgs<T>& args, cudaStream_t stream,
                           const char* operation);

/// *sum = the `count` per-block terms of dL/dscale added in double in block order, on the
/// device (one thread: the blocking form's order, so the same value run to run).
void launch_sdpa_scale_sum(const float* terms, int count, double* sum, cudaStream_t stream,
                           const char* operation);

/// The float32 values `in` rounded once to nearest even to the 16-bit storage type T (bfloat16,
/// float16), element by element (the host's conversion, precision.hpp).
template <class T>
void launch_narrow(const float* in, T* out, std::size_t count, cudaStream_t stream,
                   const char* operation);

}  // namespace emflow::detail
