// Launchers of the tensor-core kernels (kernels/mma.cuh): the check of the MMA layer
// (mma_check.cu) and the fused attention on bfloat16, float16 or float (TF32) inputs
// (tc_attention.cu). Each
// enqueues on `stream`, checks the launch, and never synchronises. Pointers are device pointers.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "attention_kernels.hpp"

namespace emflow::detail {

/// The instruction an MMA check runs (kernels/mma.cuh). tf32_pairs: the TF32 instruction on the
/// operands of the attention's P V (a through accumulator_to_a_tf32, b through
/// load_b_pairs_tf32, both with the keys of the chunk permuted).
enum class MmaKind { bf16, f16, tf32, tf32_pairs };

/// One warp computes d = a b + c with one instruction of `kind`. a: 16 x K row-major, b: K x 8
/// column-major (b[n * K + k]; tf32_pairs: row-major, b[k * 8 + n]), c, d: 16 x 8 row-major
/// floats; K = 16 for bf16 and f16 (a and b hold bfloat16 or float16), 8 for the TF32 kinds (a
/// and b hold floats, rounded to TF32 on load).
void launch_mma_check(MmaKind kind, const void* a, const void* b, const float* c, float* d,
                      cudaStream_t stream, const char* operation);

/// Registers a lane writes in the fragment-load check, and the bytes of the async-copy check.
constexpr int kFragmentLoadRegisters = 28;
constexpr int kAsyncCopyBytes = 896;

/// One warp brings a 32 x 32 row-major tile of 16-bit values (`halves`, raw bits) and a 16 x 16
/// row-major tile of floats into shared memory by 16-byte cp.async, then writes per lane l
/// (out[l * 28 + i]) the registers of: ldmatrix.x4 with lane l giving row l of the 16-bit tile
/// (i = 0..3) and the same with .trans (4..7); load_a_ldsm of rows 0..15, columns 0..15 (8..11);
/// load_b_col_pair_ldsm (12..15: first.x[0..1], second.x[0..1]) and load_b_row_pair_ldsm
/// (16..19) on the same 16 x 16 corner; load_a_tf32_ldsm of the float tile's rows 0..15, columns
/// 0..7 (20..23) and load_b_col_pair_tf32_ldsm of its rows 0..15, columns 0..7 (24..27).
void launch_fragment_load_check(const std::uint16_t* halves, const float* floats,
                                std::uint32_t* out, cudaStream_t stream, const char* operation);

/// One warp's asynchronous copies into shared memory (kAsyncCopyBytes of `src` and `out`): lane i
/// copies bytes [16 i, 16 i + 16) with i % 17 of them from src (zeros after), [512 + 4 i, +4)
/// with i % 5 and [640 + 8 i, +8) with i % 9; out receives the shared bytes, the first region
/// read by each lane after waiting for the 16-byte group only (cp.async.wait_group 1), the rest
/// by another lane after waiting for both groups and a barrier.
void launch_async_copy_check(const unsigned char* src, unsigned char* out, cudaStream_t stream,
                             const char* operation);

/// The storage type of a tensor-core attention and its products: bf16 and f16 (16-bit storage,
/// m16n8k16), tf32 (float storage, the operands rounded to TF32 for m16n8k8).
enum class TcType { bf16, f16, tf32 };

/// Per head h and cloud b, with t_ij = scale (<q_i, k_j> + bias_j) (scale includes log2(e): the
/// softmax is taken in base 2):
///   out_i = sum_j p_ij v_j,   p_ij = softmax_j(t_ij),   lse_i = ln(sum_j e^(t_ij / log2(e))),
///   entropy_i = -sum_j p_ij ln p_ij
/// over the keys j that query i sees (mask), in float32, from 16-bit queries, keys and values
/// (tf32: float ones, rounded to TF32 as the products read them, as are the probabilities).
/// A query that sees no key (a padding query) gets out = 0, lse = -inf and entropy = 0; one
/// whose visible scores give no positive sum (NaN or all -inf) gets NaN lse, entropy and out.
///
/// One launch computes every head and cloud (the grid is query blocks x heads x batch x splits).
/// Key splits (flash-decoding, as the float kernel's, FusedAttentionArgs): with splits > 1 split
/// s computes the keys [s split_keys, (s + 1) split_keys) and writes the partial state over them
/// (partial.hpp: no key seen gives out = 0, lse = -inf, entropy = 0; every visible score -inf
/// gives lse = -inf, entropy = NaN and the contents times 0) to slice s of split_out, split_lse
/// and split_entropy (slices of heads x batch x queries rows); launch_tc_attention then merges
/// them in split order (launch_merge_splits, the float kernel's merge) into out, lse and entropy,
/// which hold the same as without splits up to the order of the sums: deterministic run to run.
struct TcAttentionArgs {
  TcType type = TcType::bf16;
  const void* query = nullptr;  ///< (heads, batch, queries, dim) of `type` (tf32: float)
  const void* key = nullptr;    ///< (heads, batch, tokens, dim), or (batch, tokens, dim)
  bool shared_keys = false;     ///< key is (batch, tokens, dim), every head's (the dense X)
  const void* value = nullptr;  ///< (heads, batch, tokens, dim) of `type` (tf32: float)
  /// Grouped-query heads: key and value hold kv_heads heads, (kv_heads, batch, tokens, dim), and
  /// query head h reads kv head h / (heads / kv_heads). 0: as many as the query heads.
  int kv_heads = 0;
  /// Every array with the clouds outermost instead of the heads: query, key and value (batch,
  /// heads or kv_heads, ..., dim), key_bias (batch, heads, tokens), out, lse and entropy (and the
  /// splits' slices) (batch, heads, queries, ...): the layout of the SDPA-shaped operator.
  bool batch_major = false;
  const float* key_bias = nullptr;  ///< (heads, batch, tokens), added to <q_i, k_j>, or null
  float scale = 1.f;
  float* out = nullptr;      ///< (heads, batch, queries, dim)
  float* lse = nullptr;      ///< (heads, batch, queries), natural log, or null
  float* entropy = nullptr;  ///< (heads, batch, queries), natural log, or null
  int batch = 1, heads = 1, tokens = 1, queries = 1, dim = 1;
  /// Keys per split (a multiple of kTcBlockKeys) and splits; splits = 1: no split (split_keys is
  /// then not read).
  int split_keys = 0, splits = 1;
  /// With splits > 1: (splits, heads, batch, queries, dim), and (splits, heads, batch, queries)
  /// each for lse and entropy, floats of scratch.
  float* split_out = nullptr;
  float* split_lse = nullptr;
  float* split_entropy = nullptr;
  KernelMask mask;
};

/// Largest dim of the tensor-core attention.
constexpr int kTcMaxDim = 256;
/// Queries of one block and keys of one tile of the tensor-core attention: the geometry the key
/// splits' rule assumes (choose_key_splits, src/cuda/products_strategy.hpp), as the float kernel's.
constexpr int kTcBlockQueries = 64;
constexpr int kTcBlockKeys = 64;

/// Dynamic shared memory the tensor-core attention of `type` needs at width `dim` (bytes): 27.25,
/// 51.25 and 99.25 KiB for 16-bit storage at dim <= 64, 128, 256; 51.25, 99.25 and 195.25 KiB
/// for TF32.
std::size_t tc_shared_bytes(TcType type, int dim);

/// Allows the tensor-core attention of `type` at width `dim` its tc_shared_bytes on the current
/// device (cudaFuncSetAttribute): once per plan, on its device, before its first launch there.
void prepare_tc_attention(TcType type, int dim, const char* operation);

void launch_tc_attention(const TcAttentionArgs& args, cudaStream_t stream, const char* operation);

}  // namespace emflow::detail
