// Fused attention on tensor cores for the factored form: per head h and cloud b, with the
// projected queries Q_h, keys K_h and values V_h (computed before, stored as bfloat16, float16
// or float), a block of 64 queries streams 64-key tiles of K_h and V_h through shared memory:
//
//   S = Q K^T       mma.sync m16n8k16 (16-bit operands), or m16n8k8 with the float operands
//                   rounded to TF32 (cvt.rna) at the fragment load; float32 accumulators
//   online softmax  on the accumulator fragments in float32, base 2 (log2(e) is in the scale),
//                   with the entropy's moment sum_j w_j (t_j - m) kept relative to the running
//                   max m, rescaled with it (no difference of large terms at the end)
//   O += P V        P rounded to the storage type (or TF32) straight from the S fragments (the
//                   lane holds the A registers of P already), V from a transposed shared tile
//                   (16-bit) or as it is (TF32)
//
// TF32: the accumulators of m16n8k8 hold key columns 2t, 2t + 1 of an 8-key chunk while its A
// fragment wants columns t, t + 4; the keys of each chunk are permuted (A column t is key 2t,
// t + 4 is key 2t + 1) and V's B fragment is read with the same permutation
// (mma::accumulator_to_a_tf32, mma::load_b_pairs_tf32), so P needs no shuffle.
//
// Grid: one block per (query block, cloud, head, key split), every head and cloud in one launch
// (the dense form's keys are the cloud X for every head: TcAttentionArgs::shared_keys). Key
// splits (flash-decoding, the float kernel's rule and merge): a split's blocks see only its keys
// and write their partial states, which launch_tc_attention merges in split order
// (launch_merge_splits, key_splits.cu) into the per-head result; the head sum is the combine's,
// in head order (tc_projection.cu). No atomics: the same bits run to run.
//
// Layout of one block (128 threads, 4 warps): warp w owns query rows 16 w ... 16 w + 15 of the
// block; lane (g = lane / 4, t = lane % 4) holds rows g and g + 8 of them, and per row the keys
// (or output columns) 8 j + 2 t, 8 j + 2 t + 1 of every 8-wide tile j: a row's statistics are
// reductions over the 4 lanes of a group (shuffles with lane masks 1 and 2). Per warp and key
// tile: 8 S tiles (32 floats a lane), D / 8 output tiles (D / 2 floats a lane).
// Shared memory (16-bit): Qs[64][D+8], Ks[64][D+8] and Vt[D][64+8] (V transposed, so P V reads
// B fragments as 16-bit pairs along the keys); the rows are padded by 16 bytes so that the 8
// groups of a warp read distinct banks. D = 64, 128, 256: 27, 53 and 104 KiB. TF32: Qs, Ks and
// Vs [64][D+4] floats (padding of 4 floats: distinct banks for the A, B and the permuted V
// fragments): 51, 99 and 195 KiB, within the H200's 227 KiB a block at D = 256.
//
// Masks, key lengths and tails as the float kernel (fused_attention.cu): key tiles outside the
// block's visible band are skipped, scores outside a row's visible keys are -inf, key rows past
// the key length and columns past dim are zero in shared memory (padding tokens may hold
// anything), and a warp whose 16 rows are all beyond the query length skips the arithmetic.
// A row with no visible key so far keeps max = -inf, the exponent's reference point is then 0
// and its rescale 0 (no -inf - -inf).
//
// History: version 1: mma.sync with plain 32-bit fragment loads from shared memory, synchronous
// tile loads, one key tile in flight. Version 2 adds the entropy and the TF32 variant (float
// storage, m16n8k8), D = 64, 128, 256 each. Version 2.1 (this one): one launch for every head
// (shared keys for the dense form, which launched once per head before) and key splits. All
// checked only under the CPU emulation of CUDA (tests/cuda/emulation, the model of mma.sync in
// kernels/mma.cuh); never run or timed on a GPU.
// Tuning candidates once it can be timed, in order: cp.async (16-byte) double-buffered K and V
// tiles, ldmatrix (.trans for V, dropping the transposed tile), Q fragments kept in registers at
// D = 64, cvt.rn.bf16x2.f32 for P, 128-key tiles at D = 64. ptxas -v (sm_90, nvcc 13), version
// 1: bf16 132, 172 and 245 registers at D = 64, 128 and 256 (f16 127, 164, 247); version 2: bf16
// and f16 126, 164, 247, TF32 124, 157, 228; version 2.1: bf16 and f16 128, 166, 248, TF32 125,
// 157, 228 (the split bounds and the write place recomputed from the block index at the end, so
// D = 64 stays within 128 registers: a first try kept them live and spilled 12 bytes there); no
// spills, no stack frame. One block of 128 threads per 64 queries.
// Occupancy on the H200 (65536 registers and 228 KiB of shared memory an SM; predicted, never
// measured), blocks an SM (registers / shared memory -> blocks; blocks a wave over 132 SMs):
//   16-bit  D = 64: 4 / 8 -> 4 (528)   D = 128: 3 / 4 -> 3 (396)   D = 256: 2 / 2 -> 2 (264)
//   TF32    D = 64: 4 / 4 -> 4 (528)   D = 128: 3 / 2 -> 2 (264)   D = 256: 2 / 1 -> 1 (132)
// Version 2.1's prediction (never measured): the dense form at B = 1, N = 4096, 8 heads, d = 64
// was 8 launches of 64 blocks (64 of 132 SMs busy, one 4-warp block each); one launch of 512
// blocks fills the device (one wave of 528), about 4 times faster for the attention (each SM
// then overlaps 4 blocks' synchronous loads and MMAs). Decoding (1 query, 8 heads, 32k keys,
// d = 128) was 8 blocks streaming 512 tiles each, bound by one block's load latency (about 0.8
// ms); 64 splits of 512 keys give 512 blocks (1.3 waves) and approach the 75 MB of K and V at
// 4.8 TB/s (16 us): 25 to 40 us with the merge, 20 to 30 times faster.
//
// Next version, for Hopper (sm_90a): wgmma + TMA, the FlashAttention-3 plan. One warpgroup
// (128 threads) per 64 query rows, 2 or 3 consumer warpgroups and one producer warp per block:
//   * the producer issues cp.async.bulk.tensor (TMA) loads of K and V tiles (128 keys) into a
//     2- or 3-stage ring in shared memory, with mbarrier arrive/expect-tx per stage, and
//     setmaxnreg gives its registers to the consumers;
//   * S = Q K^T with wgmma.mma_async m64n128k16 (Q and K from shared memory via matrix
//     descriptors in the 128-byte swizzle TMA writes), accumulators in registers;
//   * softmax on the wgmma accumulator layout (each thread holds 2 rows, as here), P converted
//     in registers and used as the register A operand of O += P V (wgmma with V from shared
//     memory, V's descriptor transposed, so no transposed copy);
//   * ping-pong between two consumer warpgroups (named barriers), so one's softmax overlaps the
//     other's GEMMs; and within a warpgroup the next S GEMM is issued before this tile's softmax
//     (wgmma.commit_group / wait_group 1).
// The mma layer then gains a wgmma implementation and an emulation model of its (m64nNk16)
// fragment layout, tested the same way (tests/cuda/mma_test.cpp).
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "emflow/precision.hpp"
#include "launch.cuh"
#include "mask.cuh"
#include "mma.cuh"
#include "tc_attention.hpp"

namespace emflow::detail {

namespace {

constexpr int kThreads = 128;
constexpr int kRows = kTcBlockQueries;  // queries of a block
constexpr int kKeys = kTcBlockKeys;     // keys of a tile
constexpr float kLn2 = 0.693147180559945309f;

// 16-bit: Qs, Ks [64][D + 8] and Vt [D][64 + 8]. TF32 (float storage): Qs, Ks and Vs [64][D + 4]
// (V as it is: its B fragments are read down the keys, 2t and 2t + 1 apart, with the padding of 4
// floats putting the lanes of a warp on distinct banks).
template <class T, int D>
struct TcLayout {
  static constexpr bool tf32 = std::is_same_v<T, float>;
  static constexpr int row = tf32 ? D + 4 : D + 8;            // elements per row of Qs, Ks
  static constexpr int value_row = tf32 ? D + 4 : kKeys + 8;  // elements per row of Vt / Vs
  static constexpr int value_rows = tf32 ? kKeys : D;
  static constexpr std::size_t elements = static_cast<std::size_t>(kRows + kKeys) * row +
                                          static_cast<std::size_t>(value_rows) * value_row;
  static constexpr std::size_t bytes = elements * sizeof(T);
};
// The H200's limit is 227 KiB a block; the largest layout, TF32 at D = 256, takes 195 KiB.
static_assert(TcLayout<float, 256>::bytes <= 227 * 1024, "shared memory of a block");

template <class T>
__device__ __forceinline__ T zero_of() {
  return T{0};
}

// Rows [row0, row0 + 64) of a (rows x dim) row-major matrix into a [64][ld] shared tile
// (transposed: into [D][ld], element (r, c) at c * ld + r), zero beyond `valid` rows and dim.
template <class T, int D, bool Transposed>
__device__ __forceinline__ void load_tile(T* dst, int ld, const T* src, int row0, int valid,
                                          int dim) {
  for (int index = static_cast<int>(threadIdx.x); index < kKeys * D; index += kThreads) {
    const int r = index / D, c = index % D;
    T value = zero_of<T>();
    if (row0 + r < valid && c < dim) value = src[static_cast<std::size_t>(row0 + r) * dim + c];
    if (Transposed) {
      dst[c * ld + r] = value;
    } else {
      dst[r * ld + c] = value;
    }
  }
}

__device__ __forceinline__ float group_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float group_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// Which split, (head, cloud) and query block a block computes. Block order: the query blocks of
// one (head, cloud) adjacent, the last (which see the most keys under a causal mask) first; then
// the clouds, the heads, and the splits slowest.
struct BlockPlace {
  int split, head_cloud, query_block;
};

__device__ __forceinline__ BlockPlace block_place(const TcAttentionArgs& args, int query_blocks) {
  const unsigned per_split = static_cast<unsigned>(query_blocks) *
                             static_cast<unsigned>(args.heads) * static_cast<unsigned>(args.batch);
  const unsigned in_split = blockIdx.x % per_split;
  BlockPlace place;
  place.split = static_cast<int>(blockIdx.x / per_split);
  place.head_cloud = static_cast<int>(in_split / static_cast<unsigned>(query_blocks));
  place.query_block =
      query_blocks - 1 - static_cast<int>(in_split % static_cast<unsigned>(query_blocks));
  return place;
}

template <class T, int D>
__global__ void __launch_bounds__(kThreads)
    tc_attention_kernel(const TcAttentionArgs args, int query_blocks) {
  using Layout = TcLayout<T, D>;
  constexpr bool kTf32 = Layout::tf32;
  constexpr int kLd = Layout::row;
  constexpr int kVld = Layout::value_row;
  constexpr int kOutTiles = D / 8;
  EMFLOW_DYNAMIC_SHARED(shared_storage);
  T* const Qs = reinterpret_cast<T*>(shared_storage);
  T* const Ks = Qs + kRows * kLd;
  T* const Vt = Ks + kKeys * kLd;

  const BlockPlace place = block_place(args, query_blocks);
  const int b = place.head_cloud % args.batch;
  const int N = args.tokens, Nq = args.queries, dim = args.dim;
  const int m0 = place.query_block * kRows;
  const CloudView view = cloud_view(args.mask, b, N, Nq);
  const int length = view.key_length;
  const int split_first = args.splits > 1 ? place.split * args.split_keys : 0;
  const int split_last = args.splits > 1 ? min(N, split_first + args.split_keys) : N;
  const std::size_t head_cloud = static_cast<std::size_t>(place.head_cloud);
  // Grouped-query heads: head h's keys and values are its kv head's (h / group, cloud b).
  const int head = place.head_cloud / args.batch;
  const std::size_t kv_cloud = args.kv_heads > 0
                                   ? static_cast<std::size_t>(head / (args.heads / args.kv_heads)) *
                                             static_cast<std::size_t>(args.batch) +
                                         static_cast<std::size_t>(b)
                                   : head_cloud;
  const std::size_t key_cloud = args.shared_keys ? static_cast<std::size_t>(b) : kv_cloud;
  const T* const query = static_cast<const T*>(args.query) + head_cloud * Nq * dim;
  const T* const key = static_cast<const T*>(args.key) + key_cloud * N * dim;
  const T* const value = static_cast<const T*>(args.value) + kv_cloud * N * dim;
  const float* const bias = args.key_bias != nullptr ? args.key_bias + head_cloud * N : nullptr;

  // Key tiles that can hold a visible key of some query of the block, within its split.
  int first_key = 0, last_key = 0;
  if (m0 < view.query_length) {
    int unused = 0;
    visible_keys(args.mask, view, m0, &first_key, &unused);
    visible_keys(args.mask, view, min(view.query_length, m0 + kRows) - 1, &unused, &last_key);
  }
  first_key = max(first_key, split_first);
  last_key = min(last_key, split_last);
  first_key = (first_key / kKeys) * kKeys;

  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int g = mma::lane_group(), t = mma::lane_in_group();
  const int row0 = 16 * warp;  // the warp's first row in the block
  // The same for every lane: the warp's shuffles and MMAs run with the whole warp or not at all.
  const bool warp_active = m0 + row0 < view.query_length;
  const int k_steps = kTf32 ? (dim + 7) / 8 : (dim + 15) / 16;
  const int out_tiles = (dim + 7) / 8;

  int first[2], last[2];  // visible keys of the lane's rows g and g + 8, within the split
  // row_moment: sum_j w_j (t_j - reference) over the lane's keys of the row, kept relative to
  // the running reference so that the entropy needs no difference of large terms.
  float row_max[2], row_sum[2], row_moment[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    visible_keys(args.mask, view, m0 + row0 + g + 8 * r, &first[r], &last[r]);
    first[r] = max(first[r], split_first);
    last[r] = max(first[r], min(last[r], split_last));
    row_max[r] = -INFINITY;
    row_sum[r] = 0.f;
    row_moment[r] = 0.f;
  }
  mma::FragC o[kOutTiles];
#pragma unroll
  for (int n = 0; n < kOutTiles; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) o[n].x[e] = 0.f;
  }

  load_tile<T, D, false>(Qs, kLd, query, m0, Nq, dim);

  for (int n0 = first_key; n0 < last_key; n0 += kKeys) {
    __syncthreads();  // the previous tiles have been read
    load_tile<T, D, false>(Ks, kLd, key, n0, length, dim);
    load_tile<T, D, !kTf32>(Vt, kVld, value, n0, length, dim);
    __syncthreads();  // tiles (and, the first time, the queries) in place
    if (!warp_active) continue;

    mma::FragC s[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[j].x[e] = 0.f;
    }
    for (int kk = 0; kk < k_steps; ++kk) {
      if constexpr (kTf32) {
        const mma::FragA a = mma::load_a_tf32(Qs + row0 * kLd + 8 * kk, kLd);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          mma::mma_1688_tf32(s[j], a, mma::load_b_col_tf32(Ks + 8 * j * kLd + 8 * kk, kLd));
        }
      } else {
        const mma::FragA a = mma::load_a(Qs + row0 * kLd + 16 * kk, kLd);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          mma::mma_16816<T>(s[j], a, mma::load_b_col(Ks + 8 * j * kLd + 16 * kk, kLd));
        }
      }
    }

    // Scores in base 2, masked; then the online softmax of the lane's two rows.
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e >> 1;
        const int k = n0 + 8 * j + 2 * t + (e & 1);
        float score = -INFINITY;
        if (k >= first[r] && k < last[r]) {
          score = args.scale * (s[j].x[e] + (bias != nullptr ? bias[k] : 0.f));
        }
        s[j].x[e] = score;
        tile_max[r] = fmaxf(tile_max[r], score);
      }
    }
    float rescale[2], reference[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float new_max = fmaxf(row_max[r], group_max(tile_max[r]));
      reference[r] = new_max == -INFINITY ? 0.f : new_max;
      const float shift = row_max[r] == -INFINITY ? 0.f : row_max[r] - reference[r];  // <= 0
      rescale[r] = row_max[r] == -INFINITY ? 0.f : exp2f(shift);
      row_max[r] = new_max;
      row_moment[r] = rescale[r] * (row_moment[r] + shift * row_sum[r]);
      row_sum[r] *= rescale[r];
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e >> 1;
        float weight = 0.f;
        if (s[j].x[e] != -INFINITY) {
          const float centred = s[j].x[e] - reference[r];
          weight = exp2f(centred);
          row_sum[r] += weight;
          row_moment[r] = fmaf(weight, centred, row_moment[r]);
        }
        s[j].x[e] = weight;
      }
    }
#pragma unroll
    for (int n = 0; n < kOutTiles; ++n) {
      o[n].x[0] *= rescale[0];
      o[n].x[1] *= rescale[0];
      o[n].x[2] *= rescale[1];
      o[n].x[3] *= rescale[1];
    }

    // O += P V over the tile's keys, 16 (TF32: 8, keys permuted within the chunk as
    // accumulator_to_a_tf32 says) at a time; weight 0 and value 0 beyond the tile's keys.
    if constexpr (kTf32) {
#pragma unroll
      for (int kc = 0; kc < 8; ++kc) {
        const mma::FragA p = mma::accumulator_to_a_tf32(s[kc]);
#pragma unroll
        for (int n = 0; n < kOutTiles; ++n) {
          if (n < out_tiles) {
            mma::mma_1688_tf32(o[n], p, mma::load_b_pairs_tf32(Vt + 8 * kc * kVld + 8 * n, kVld));
          }
        }
      }
    } else {
#pragma unroll
      for (int kc = 0; kc < 4; ++kc) {
        const mma::FragA p = mma::accumulators_to_a<T>(s[2 * kc], s[2 * kc + 1]);
#pragma unroll
        for (int n = 0; n < kOutTiles; ++n) {
          if (n < out_tiles) {
            mma::mma_16816<T>(o[n], p, mma::load_b_col(Vt + 8 * n * kVld + 16 * kc, kVld));
          }
        }
      }
    }
  }

  // Row totals over the group, then normalise and write.
  if (warp_active) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      row_sum[r] = group_sum(row_sum[r]);
      row_moment[r] = group_sum(row_moment[r]);
    }
  }
  // Where the block writes, from the block index again rather than kept in registers through the
  // key loop: split s writes slice s, heads x batch x queries rows further on.
  const BlockPlace at = block_place(args, query_blocks);
  const std::size_t stat_base =
      (static_cast<std::size_t>(at.split) * args.heads * args.batch + at.head_cloud) * Nq;
  const int m_first = at.query_block * kRows;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int qi = m_first + row0 + g + 8 * r;
    if (qi >= Nq) continue;
    // A real query sees a key; a sum that is not > 0 is NaN or comes from -inf scores only. A
    // partial state keeps the all -inf case (sum 0) apart, as the float kernel does: a later
    // merge with a finite score defines it (lse = -inf, H = NaN, the contents times 0).
    const bool any_key = first[r] < last[r];
    const bool defined = row_sum[r] > 0.f;
    const bool unweighted = args.splits > 1 && row_sum[r] == 0.f;
    const float inverse = defined ? 1.f / row_sum[r] : (unweighted ? 1.f : NAN);
    float* const out = args.out + (stat_base + qi) * dim;
#pragma unroll
    for (int n = 0; n < kOutTiles; ++n) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = 8 * n + 2 * t + e;
        if (col < dim) out[col] = any_key ? o[n].x[2 * r + e] * inverse : 0.f;
      }
    }
    const float log2_sum = defined ? log2f(row_sum[r]) : NAN;
    if (t == 0 && args.lse != nullptr) {
      args.lse[stat_base + qi] =
          any_key && !unweighted ? (row_max[r] + log2_sum) * kLn2 : -INFINITY;
    }
    // H = ln Z - sum_j p_j s_j = ln 2 (log2 of the sum - moment / sum) relative to the reference.
    if (t == 0 && args.entropy != nullptr) {
      args.entropy[stat_base + qi] = any_key ? kLn2 * (log2_sum - row_moment[r] * inverse) : 0.f;
    }
  }
}

template <class T, int D>
void launch_dim(const TcAttentionArgs& args, cudaStream_t stream, const char* operation) {
  const std::size_t bytes = TcLayout<T, D>::bytes;
  const int query_blocks = (args.queries + kRows - 1) / kRows;
  const unsigned blocks = static_cast<unsigned>(query_blocks) * static_cast<unsigned>(args.heads) *
                          static_cast<unsigned>(args.batch) * static_cast<unsigned>(args.splits);
  launch(operation, "tc_attention_kernel", tc_attention_kernel<T, D>, blocks, kThreads, bytes,
         stream, args, query_blocks);
}

// The dynamic shared memory of the kernel of storage T that computes width `dim`, and the
// attribute that allows it on the current device.
template <class T>
std::size_t shared_bytes(int dim) {
  if (dim <= 64) return TcLayout<T, 64>::bytes;
  if (dim <= 128) return TcLayout<T, 128>::bytes;
  return TcLayout<T, 256>::bytes;
}

template <class T, int D>
void allow_tile(const char* operation) {
  check_cuda(
      cudaFuncSetAttribute(tc_attention_kernel<T, D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(TcLayout<T, D>::bytes)),
      operation, "cudaFuncSetAttribute(tc_attention_kernel)");
}

template <class T>
void allow_shared_memory(int dim, const char* operation) {
  if (dim <= 64) {
    allow_tile<T, 64>(operation);
  } else if (dim <= 128) {
    allow_tile<T, 128>(operation);
  } else {
    allow_tile<T, 256>(operation);
  }
}

template <class T>
void launch_type(const TcAttentionArgs& args, cudaStream_t stream, const char* operation) {
  if (args.dim <= 64) {
    launch_dim<T, 64>(args, stream, operation);
  } else if (args.dim <= 128) {
    launch_dim<T, 128>(args, stream, operation);
  } else {
    launch_dim<T, 256>(args, stream, operation);
  }
}

// The kernel of args.type, one launch.
void launch_kernel(const TcAttentionArgs& args, cudaStream_t stream, const char* operation) {
  switch (args.type) {
    case TcType::bf16:
      launch_type<bfloat16>(args, stream, operation);
      break;
    case TcType::f16:
      launch_type<float16>(args, stream, operation);
      break;
    case TcType::tf32:
      launch_type<float>(args, stream, operation);
      break;
  }
}

}  // namespace

std::size_t tc_shared_bytes(TcType type, int dim) {
  switch (type) {
    case TcType::bf16:
      return shared_bytes<bfloat16>(dim);
    case TcType::f16:
      return shared_bytes<float16>(dim);
    case TcType::tf32:
      break;
  }
  return shared_bytes<float>(dim);
}

void prepare_tc_attention(TcType type, int dim, const char* operation) {
  switch (type) {
    case TcType::bf16:
      allow_shared_memory<bfloat16>(dim, operation);
      return;
    case TcType::f16:
      allow_shared_memory<float16>(dim, operation);
      return;
    case TcType::tf32:
      allow_shared_memory<float>(dim, operation);
      return;
  }
}

void launch_tc_attention(const TcAttentionArgs& args, cudaStream_t stream, const char* operation) {
  if (args.splits <= 1) {
    launch_kernel(args, stream, operation);
    return;
  }
  // The kernel writes each split's partial state to the scratch; the merge folds them in split
  // order into the per-head result, as attend's states (every visible score -inf is NaN).
  TcAttentionArgs split = args;
  split.out = args.split_out;
  split.lse = args.split_lse;
  split.entropy = args.split_entropy;
  launch_kernel(split, stream, operation);
  SplitMerge merge;
  merge.rows = args.split_out;
  merge.lse = args.split_lse;
  merge.entropy = args.split_entropy;
  merge.splits = args.splits;
  // The (heads, batch) rows are merged one by one: their order does not matter to the merge.
  merge.batch = args.batch;
  merge.heads = args.heads;
  merge.queries = args.queries;
  merge.dim = args.dim;
  merge.heads_out = args.out;
  merge.lse_out = args.lse;
  merge.entropy_out = args.entropy;
  merge.attend_states = true;
  launch_merge_splits(merge, stream, operation);
}

}  // namespace emflow::detail
