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
//                   lane holds the A registers of P already), V's B fragments read from the
//                   row-major value tile by ldmatrix.trans (16-bit) or down the keys (TF32)
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
// Shared memory: Qs, Ks and Vs [64][D + 8] of the 16-bit type, or [64][D + 4] floats (TF32),
// all row-major as the arrays are in global memory, and the key tile's 64 bias floats. Each row
// is 16 bytes longer than the tile, so rows stay 16-byte aligned for cp.async and ldmatrix and
// the 8 rows an ldmatrix phase reads start 4 banks apart (no bank conflict; the same for the
// TF32 value fragments read down the keys). 16-bit: 27.25, 51.25 and 99.25 KiB at D = 64, 128,
// 256; TF32: 51.25, 99.25 and 195.25 KiB, within the H200's 227 KiB a block.
//
// Loads: 16-byte cp.async (mma::cp_async, zero-filled past the key length and dim) when every
// row of Q, K and V is whole 16-byte chunks from an aligned array (dim * sizeof(T) a multiple of
// 16: dim % 8 == 0 for 16-bit, % 4 for float), else plain element loads into the same layout.
// The pipeline is FlashAttention-2's, with the key and value tiles as the two buffers: at step
// i, wait for K_i (and its bias), barrier, issue V_i, compute S_i and its softmax while V_i
// lands; wait for V_i, barrier, issue K_{i+1}, compute P_i V_i while K_{i+1} lands. Two barriers
// a tile, as before, but no load is waited for right after it is issued. Fragments: the 16-bit
// A and B operands by ldmatrix.x4 (one instruction per A operand or per pair of 8-key B tiles;
// .trans for V), the TF32 Q and K operands by ldmatrix.x4 as well (a b16 8 x 8 matrix is 8 rows
// of 4 floats), TF32 V by plain float loads (ldmatrix.trans moves 16-bit halves, not floats).
//
// Masks, key lengths and tails as the float kernel (fused_attention.cu): key tiles outside the
// block's visible band are skipped, scores outside a row's visible keys are -inf, key rows past
// the key length and columns past dim are zero in shared memory (padding tokens may hold
// anything), and a warp whose 16 rows are all beyond the query length skips the arithmetic.
// No branch per score: the bias is added from the tile's shared copy under one test per tile
// (whether the launch has a bias); a tile inside the keys every row of the warp sees (the band
// [max first, min last) over the warp's rows that see a key) skips the mask; any other tile
// masks each score by a select. A masked score's weight is exp2(-inf) = 0 and its term of the
// entropy's moment is made 0 by a select (no 0 x -inf).
// A row with no visible key so far keeps max = -inf, the exponent's reference point is then 0
// and its rescale 0 (no -inf - -inf).
//
// History: version 1: mma.sync with plain 32-bit fragment loads from shared memory, synchronous
// tile loads, one key tile in flight. Version 2 adds the entropy and the TF32 variant (float
// storage, m16n8k8), D = 64, 128, 256 each. Version 2.1: one launch for every head (shared keys
// for the dense form, which launched once per head before) and key splits. Version 3 (this
// one): cp.async tiles in the pipeline above, ldmatrix fragments, V row-major (no transposed
// store), the bias from a shared tile and no branch per score. All checked only under the CPU
// emulation of CUDA (tests/cuda/emulation: the models of mma.sync, ldmatrix and cp.async in
// kernels/mma.cuh and emu_block.h); never run or timed on a GPU.
// Tuning candidates once it can be timed, in order: Q fragments kept in registers at D = 64,
// cvt.rn.bf16x2.f32 for P, 128-key tiles at D = 64, a third stage (K_{i+1} issued before S_i).
// ptxas -v (sm_90, nvcc 13), version 1: bf16 132, 172 and 245 registers at D = 64, 128 and 256
// (f16 127, 164, 247); version 2: bf16 and f16 126, 164, 247, TF32 124, 157, 228; version 2.1:
// bf16 and f16 128, 166, 248, TF32 125, 157, 228 (the split bounds and the write place
// recomputed from the block index at the end, so D = 64 stays within 128 registers: a first try
// kept them live and spilled 12 bytes there); version 3: bf16 128, 168, 250, f16 128, 168, 252,
// TF32 128, 168, 252; no spills, no stack frame. One block of 128 threads per 64 queries.
// Occupancy on the H200 (65536 registers and 228 KiB of shared memory an SM; predicted, never
// measured), blocks an SM (registers / shared memory -> blocks; blocks a wave over 132 SMs),
// the same in versions 2.1 and 3:
//   16-bit  D = 64: 4 / 8 -> 4 (528)   D = 128: 3 / 4 -> 3 (396)   D = 256: 2 / 2 -> 2 (264)
//   TF32    D = 64: 4 / 4 -> 4 (528)   D = 128: 3 / 2 -> 2 (264)   D = 256: 2 / 1 -> 1 (132)
// Version 3's prediction (never measured), bf16, N = 16k, d = 128, one block of 4 warps per 64
// queries, 3 blocks an SM: version 2.1 loaded each 16 KiB K or V tile with 2-byte loads between
// two barriers (8192 loads a tile, 64 per thread, their latency exposed once per tile and the
// transposed V store 4-way bank conflicted); version 3 issues 8 16-byte copies per thread per
// tile and hides their latency behind the other half-step's MMAs, and reads each B operand pair
// with one ldmatrix where 4 32-bit loads were. Expected: the attention goes from load-bound
// (predicted 100 to 200 TFLOP/s for version 1) toward the mma.sync issue limit, 250 to 350
// TFLOP/s (about a third of the H200's dense bf16 peak, the usual ceiling of mma.sync kernels
// without wgmma); TF32 at half that. The bias and mask changes remove two branches and a
// global load per score inside the band: a few percent on masked problems, none without.
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

#include <climits>
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

// Shared memory: Qs, Ks and Vs, each [64][row] of T, row-major (tokens down, the head's width
// across), row = D + 8 for 16-bit storage and D + 4 for float (TF32): rows 16 bytes longer than
// the tile, so the rows stay 16-byte aligned (cp.async, ldmatrix) and the 8 rows one ldmatrix
// phase reads (or the 8 groups of a warp's plain loads) start 4 banks apart: no bank conflict.
// Then the key tile's bias, 64 floats.
template <class T, int D>
struct TcLayout {
  static constexpr bool tf32 = std::is_same_v<T, float>;
  static constexpr int row = tf32 ? D + 4 : D + 8;  // elements per row of Qs, Ks, Vs
  static constexpr std::size_t tile = static_cast<std::size_t>(kKeys) * row;  // elements
  static constexpr std::size_t bias_offset = 3 * tile * sizeof(T);            // bytes
  static constexpr std::size_t bytes = bias_offset + kKeys * sizeof(float);
  static_assert(kRows == kKeys, "the query tile has the key tile's shape");
  static_assert((row * sizeof(T)) % 16 == 0, "16-byte aligned rows");
};
// The H200's limit is 227 KiB a block; the largest layout, TF32 at D = 256, takes 195.25 KiB.
static_assert(TcLayout<float, 256>::bytes <= 227 * 1024, "shared memory of a block");

// Rows [row0, row0 + 64) of a (rows x dim) row-major matrix of T into a [64][Layout::row] shared
// tile, zero beyond `valid` rows and beyond dim. With `async_rows` (every row of the matrix is
// whole 16-byte chunks from a 16-byte aligned base: dim * sizeof(T) % 16 == 0) by 16-byte
// cp.async (zero-filled outside), landing at the issuing thread's next wait; else by plain loads
// and stores of one element (a dim that leaves a partial chunk), in place at once.
template <class T, int D>
__device__ __forceinline__ void issue_tile(T* dst, const T* src, int row0, int valid, int dim,
                                           bool async_rows) {
  constexpr int kLd = TcLayout<T, D>::row;
  if (async_rows) {
    constexpr int kChunk = 16 / static_cast<int>(sizeof(T));  // elements of a 16-byte copy
    constexpr int kChunks = D / kChunk;                       // copies of a tile row
    for (int index = static_cast<int>(threadIdx.x); index < kKeys * kChunks; index += kThreads) {
      const int r = index / kChunks, c = (index % kChunks) * kChunk;
      const bool inside = row0 + r < valid && c < dim;
      const T* const from = inside ? src + static_cast<std::size_t>(row0 + r) * dim + c : src;
      mma::cp_async<16>(dst + r * kLd + c, from, inside ? 16 : 0);
    }
    return;
  }
  for (int index = static_cast<int>(threadIdx.x); index < kKeys * D; index += kThreads) {
    const int r = index / D, c = index % D;
    T value = T{0};
    if (row0 + r < valid && c < dim) value = src[static_cast<std::size_t>(row0 + r) * dim + c];
    dst[r * kLd + c] = value;
  }
}

// The bias of keys [n0, n0 + 64) into the tile's 64 floats (zero past the tokens), by 4-byte
// cp.async.
__device__ __forceinline__ void issue_bias(float* dst, const float* bias, int n0, int tokens) {
  const int i = static_cast<int>(threadIdx.x);
  if (i < kKeys) {
    const bool inside = n0 + i < tokens;
    mma::cp_async<4>(dst + i, inside ? bias + n0 + i : bias, inside ? 4 : 0);
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
// The largest and smallest of an int over the warp.
__device__ __forceinline__ int warp_max(int v) {
  for (int m = 1; m < 32; m <<= 1) v = max(v, static_cast<int>(__shfl_xor_sync(0xffffffffu, v, m)));
  return v;
}
__device__ __forceinline__ int warp_min(int v) {
  for (int m = 1; m < 32; m <<= 1) v = min(v, static_cast<int>(__shfl_xor_sync(0xffffffffu, v, m)));
  return v;
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

// The row of (head, cloud) index head_cloud = head x batch + cloud in the per-head arrays:
// itself, or cloud x heads + head where the clouds are outermost (batch_major).
__device__ __forceinline__ std::size_t array_row(const TcAttentionArgs& args, int head_cloud) {
  if (!args.batch_major) return static_cast<std::size_t>(head_cloud);
  return static_cast<std::size_t>(head_cloud % args.batch) * static_cast<std::size_t>(args.heads) +
         static_cast<std::size_t>(head_cloud / args.batch);
}

template <class T, int D>
__global__ void __launch_bounds__(kThreads)
    tc_attention_kernel(const TcAttentionArgs args, int query_blocks, bool async_rows) {
  using Layout = TcLayout<T, D>;
  constexpr bool kTf32 = Layout::tf32;
  constexpr int kLd = Layout::row;
  constexpr int kOutTiles = D / 8;
  EMFLOW_DYNAMIC_SHARED(shared_storage);
  T* const Qs = reinterpret_cast<T*>(shared_storage);
  T* const Ks = Qs + Layout::tile;
  T* const Vs = Ks + Layout::tile;
  float* const Bs = reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(shared_storage) +
                                             Layout::bias_offset);

  const BlockPlace place = block_place(args, query_blocks);
  const int b = place.head_cloud % args.batch;
  const int N = args.tokens, Nq = args.queries, dim = args.dim;
  const int m0 = place.query_block * kRows;
  const CloudView view = cloud_view(args.mask, b, N, Nq);
  const int length = view.key_length;
  const int split_first = args.splits > 1 ? place.split * args.split_keys : 0;
  const int split_last = args.splits > 1 ? min(N, split_first + args.split_keys) : N;
  const std::size_t head_cloud = array_row(args, place.head_cloud);
  // Grouped-query heads: head h's keys and values are its kv head's (h / group, cloud b).
  const int head = place.head_cloud / args.batch;
  const int kv_heads = args.kv_heads > 0 ? args.kv_heads : args.heads;
  const int kv_head = args.kv_heads > 0 ? head / (args.heads / args.kv_heads) : head;
  const std::size_t kv_cloud =
      args.batch_major
          ? static_cast<std::size_t>(b) * static_cast<std::size_t>(kv_heads) + kv_head
          : static_cast<std::size_t>(kv_head) * static_cast<std::size_t>(args.batch) + b;
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
  // The keys every row of the warp that sees a key sees: a key tile inside [band_first,
  // band_last) needs no mask (rows that see no key write zeros whatever they sum).
  const int band_first =
      warp_max(max(first[0] < last[0] ? first[0] : 0, first[1] < last[1] ? first[1] : 0));
  const int band_last =
      warp_min(min(first[0] < last[0] ? last[0] : INT_MAX, first[1] < last[1] ? last[1] : INT_MAX));
  mma::FragC o[kOutTiles];
#pragma unroll
  for (int n = 0; n < kOutTiles; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) o[n].x[e] = 0.f;
  }

  // The pipeline (FlashAttention-2's order): the value tile of step i loads while the scores
  // and the softmax of step i compute, the key tile (and bias) of step i + 1 while P V of step
  // i computes. Group 1: the queries and the first key tile.
  if (first_key < last_key) {
    issue_tile<T, D>(Qs, query, m0, Nq, dim, async_rows);
    issue_tile<T, D>(Ks, key, first_key, length, dim, async_rows);
    if (bias != nullptr) issue_bias(Bs, bias, first_key, N);
    mma::cp_async_commit();
  }
  for (int n0 = first_key; n0 < last_key; n0 += kKeys) {
    mma::cp_async_wait<0>();
    __syncthreads();  // the key tile (and queries, bias) in place; the last value tile read
    issue_tile<T, D>(Vs, value, n0, length, dim, async_rows);
    mma::cp_async_commit();

    mma::FragC s[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[j].x[e] = 0.f;
    }
    float rescale[2] = {1.f, 1.f}, reference[2] = {0.f, 0.f};
    if (warp_active) {
      for (int kk = 0; kk < k_steps; ++kk) {
        if constexpr (kTf32) {
          const mma::FragA a = mma::load_a_tf32_ldsm(Qs + row0 * kLd + 8 * kk, kLd);
#pragma unroll
          for (int j = 0; j < 8; j += 2) {
            mma::FragB b0, b1;
            mma::load_b_col_pair_tf32_ldsm(Ks + 8 * j * kLd + 8 * kk, kLd, b0, b1);
            mma::mma_1688_tf32(s[j], a, b0);
            mma::mma_1688_tf32(s[j + 1], a, b1);
          }
        } else {
          const mma::FragA a = mma::load_a_ldsm(Qs + row0 * kLd + 16 * kk, kLd);
#pragma unroll
          for (int j = 0; j < 8; j += 2) {
            mma::FragB b0, b1;
            mma::load_b_col_pair_ldsm(Ks + 8 * j * kLd + 16 * kk, kLd, b0, b1);
            mma::mma_16816<T>(s[j], a, b0);
            mma::mma_16816<T>(s[j + 1], a, b1);
          }
        }
      }

      // Scores in base 2: the bias (a choice of the launch, one branch a tile), then the mask,
      // skipped where the tile lies inside every row's visible keys (the same for the warp) and
      // else a select per score, no branch; then the online softmax of the lane's two rows.
      if (bias != nullptr) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const float left = Bs[8 * j + 2 * t], right = Bs[8 * j + 2 * t + 1];
          s[j].x[0] += left;
          s[j].x[1] += right;
          s[j].x[2] += left;
          s[j].x[3] += right;
        }
      }
      const bool unmasked = n0 >= band_first && n0 + kKeys <= band_last;
      float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = e >> 1;
          const int k = n0 + 8 * j + 2 * t + (e & 1);
          float score = args.scale * s[j].x[e];
          if (!unmasked) score = k >= first[r] && k < last[r] ? score : -INFINITY;
          s[j].x[e] = score;
          tile_max[r] = fmaxf(tile_max[r], score);
        }
      }
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
      // A masked score (-inf) weighs exp2(-inf) = 0 and adds nothing to the moment (its
      // centred score is replaced by 0, so no 0 x -inf); a NaN score makes the sum NaN.
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = e >> 1;
          const float centred = s[j].x[e] - reference[r];
          const float weight = exp2f(centred);
          row_sum[r] += weight;
          row_moment[r] = fmaf(weight, s[j].x[e] == -INFINITY ? 0.f : centred, row_moment[r]);
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
    }

    mma::cp_async_wait<0>();
    __syncthreads();  // the value tile in place; every warp done with the key tile and bias
    if (n0 + kKeys < last_key) {
      issue_tile<T, D>(Ks, key, n0 + kKeys, length, dim, async_rows);
      if (bias != nullptr) issue_bias(Bs, bias, n0 + kKeys, N);
      mma::cp_async_commit();
    }
    if (!warp_active) continue;

    // O += P V over the tile's keys, 16 (TF32: 8, keys permuted within the chunk as
    // accumulator_to_a_tf32 says) at a time; weight 0 and value 0 beyond the tile's keys.
    if constexpr (kTf32) {
#pragma unroll
      for (int kc = 0; kc < 8; ++kc) {
        const mma::FragA p = mma::accumulator_to_a_tf32(s[kc]);
#pragma unroll
        for (int n = 0; n < kOutTiles; ++n) {
          if (n < out_tiles) {
            mma::mma_1688_tf32(o[n], p, mma::load_b_pairs_tf32(Vs + 8 * kc * kLd + 8 * n, kLd));
          }
        }
      }
    } else {
#pragma unroll
      for (int kc = 0; kc < 4; ++kc) {
        const mma::FragA p = mma::accumulators_to_a<T>(s[2 * kc], s[2 * kc + 1]);
#pragma unroll
        for (int n = 0; n < kOutTiles; n += 2) {
          if (n < out_tiles) {
            mma::FragB b0, b1;
            mma::load_b_row_pair_ldsm(Vs + 16 * kc * kLd + 8 * n, kLd, b0, b1);
            mma::mma_16816<T>(o[n], p, b0);
            if (n + 1 < out_tiles) mma::mma_16816<T>(o[n + 1], p, b1);
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
  const std::size_t stat_base = (static_cast<std::size_t>(at.split) * args.heads * args.batch +
                                 array_row(args, at.head_cloud)) *
                                Nq;
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

// Whether the tiles of query, key and value can be brought in by 16-byte copies: rows of whole
// 16-byte chunks (dim * sizeof(T) a multiple of 16) from 16-byte aligned arrays.
template <class T>
bool async_rows(const TcAttentionArgs& args) {
  const auto aligned = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; };
  return (static_cast<std::size_t>(args.dim) * sizeof(T)) % 16 == 0 && aligned(args.query) &&
         aligned(args.key) && aligned(args.value);
}

template <class T, int D>
void launch_dim(const TcAttentionArgs& args, cudaStream_t stream, const char* operation) {
  const std::size_t bytes = TcLayout<T, D>::bytes;
  const int query_blocks = (args.queries + kRows - 1) / kRows;
  const unsigned blocks = static_cast<unsigned>(query_blocks) * static_cast<unsigned>(args.heads) *
                          static_cast<unsigned>(args.batch) * static_cast<unsigned>(args.splits);
  launch(operation, "tc_attention_kernel", tc_attention_kernel<T, D>, blocks, kThreads, bytes,
         stream, args, query_blocks, async_rows<T>(args));
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
