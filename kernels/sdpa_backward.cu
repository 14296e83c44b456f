// The SDPA-shaped operator's own kernels: its float32 forward pass, and its backward pass
// (docs/MATH.md §8.2, §8.3) in float32 (below) and on the tensor cores for 16-bit storage
// (version 2, further down), in the FlashAttention-2 form:
// the weights are recomputed from lse, never stored. By default without atomics: each gradient is
// owned by the blocks of one kernel, so the result is the same bits run to run; the atomics mode
// (SdpaBackwardArgs::atomic_queries) adds dQ from the keys kernel instead.
//
//   sdpa_backward_keys_kernel<D>    one block per (key tile of 64, kv head, cloud): for each query
//       head of the group and each tile of 64 queries that sees a key of the tile, recompute
//       S = scale Q K^T, P = exp(S - lse), dP = dO V^T and dS = P (dP - dH S - E) on the 64 x 64
//       pairs, then dV += P^T dO and dK += dS^T Q, kept in registers across the tiles.
//   sdpa_backward_queries_kernel<D> one block per (query tile of 64, head, cloud): for each key
//       tile the queries see, the same pair terms, then dQ += dS K in registers; and per block
//       sum dS_ij <q_i, k_j> (the scale's gradient, summed by sdpa_scale_sum_kernel in a fixed
//       order).
//
// D (64 or 128) bounds rank and value_rank; the true widths are run-time values (columns beyond
// them are zero in shared memory). Layout of one block (256 threads = 16 x 16, thread (ty, tx)):
// pair terms for rows 4 ty + a (a < 4) and keys tx + 16 c (c < 4), a 4 x 4 register tile, as the
// forward's fused kernel; the gradients for rows (or keys) 4 ty + a and columns tx + 16 c
// (c < D / 16). Shared memory, floats: four [64][D + 1] tiles (Q and dO, K and V; the odd row
// length puts the 16 rows a half-warp reads in distinct banks), P and dS [64][65], and the row
// terms lse, E, dH: 98.25 KiB at D = 64, 162.25 KiB at D = 128 (two blocks an SM at D = 64,
// one at 128, on the H200's 228 KiB). ptxas -v (sm_90, nvcc 13): the keys kernel 128 and 174
// registers at D = 64 and 128, the queries kernel 128 and 128; no spills, no stack frame.
//
//   sdpa_forward_kernel<D>          the forward pass in float32 (Precision::fp32): one block per
//       (query tile of 64, head, cloud), the same tiles, layout and skipping, S and an online
//       softmax in base 2 per row (as the fused attention kernel), O += P V in registers; o, lse
//       and H written once. Prediction for the H200 (never measured): bound by FFMA issue and
//       unpipelined loads like the fused kernel, 15 to 25 TFLOP/s at D = 64 and 128.
//
// Masks, lengths and padding as the forward: tiles outside a block's visible band are skipped,
// pairs outside a row's visible keys weigh 0, rows beyond the query length and keys beyond the
// key length are read as zeros (padding may hold anything), so a query without keys gets dQ = 0
// and a key that no query sees dK = dV = 0. The caller makes E, dH and dO zero on rows that see
// no key (their saved statistics are never read) and sends non-finite input to the reference.
//
// Version 1: plain FFMA register tiles and synchronous loads, written to be checked under the CPU
// emulation of CUDA (tests/cuda/emulation) before it can be timed; never run on a GPU. Prediction
// for the H200 (never measured): 5 products of 64 x 64 x D per tile pair against the forward's 2,
// bound like the forward's float kernel by FFMA issue and unpipelined loads: about 15 to 25
// TFLOP/s in float32 at D = 64 and 128 (the FFMA peak is 67), two to three times the forward's
// time. The path toward FlashAttention-2's class (300 TFLOP/s in bf16) is the tensor-core
// version: the five products on mma.sync through kernels/mma.cuh, cp.async tiles, and dQ by
// atomics or per-split buffers.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "launch.cuh"
#include "mask.cuh"
#include "mma.cuh"
#include "sdpa_backward.hpp"
#include "storage.cuh"

namespace emflow::detail {

namespace {

constexpr int kThreads = 256;
constexpr int kTile = kSdpaBackwardTile;
constexpr int kPairLd = kTile + 1;

template <int D>
struct BackwardLayout {
  static constexpr int ld = D + 1;
  static constexpr std::size_t tile = static_cast<std::size_t>(kTile) * ld;  // floats
  static constexpr std::size_t floats =
      4 * tile + 2 * static_cast<std::size_t>(kTile) * kPairLd + 3 * kTile;
  static constexpr std::size_t bytes = floats * sizeof(float);
};
static_assert(BackwardLayout<kSdpaBackwardMaxRank>::bytes <= 227 * 1024, "shared memory");

// The block's shared arrays.
template <int D>
struct Shared {
  float *a, *b, *c, *d;                  // [64][D + 1] each: the two row tiles of each side
  float *weights, *score_gradients;      // P and dS, [64][65] (row i, key j)
  float *lse, *term, *entropy_gradient;  // per row of the query tile

  __device__ explicit Shared(float* base) {
    using L = BackwardLayout<D>;
    a = base;
    b = a + L::tile;
    c = b + L::tile;
    d = c + L::tile;
    weights = d + L::tile;
    score_gradients = weights + kTile * kPairLd;
    lse = score_gradients + kTile * kPairLd;
    term = lse + kTile;
    entropy_gradient = term + kTile;
  }
};

// Rows [row0, row0 + 64) of a (rows x width) row-major matrix into a [64][D + 1] tile, zero
// beyond `valid` rows and beyond `width` columns.
template <int D>
__device__ __forceinline__ void load_rows(float* dst, const float* src, int row0, int valid,
                                          int width) {
  for (int index = static_cast<int>(threadIdx.x); index < kTile * D; index += kThreads) {
    const int r = index / D, c = index % D;
    float v = 0.f;
    if (row0 + r < valid && c < width) v = src[static_cast<std::size_t>(row0 + r) * width + c];
    dst[r * (D + 1) + c] = v;
  }
}

// The row terms of the query tile [m0, m0 + 64): lse, E and dH (zero beyond `valid` rows and
// where dH is absent).
__device__ __forceinline__ void load_row_terms(float* lse, float* term, float* entropy_gradient,
                                               const SdpaBackwardArgs& args, std::size_t row_base,
                                               int m0, int valid) {
  const int r = static_cast<int>(threadIdx.x);
  if (r < kTile) {
    const bool inside = m0 + r < valid;
    const std::size_t at = row_base + static_cast<std::size_t>(m0 + r);
    lse[r] = inside ? args.lse[at] : 0.f;
    term[r] = inside ? args.row_term[at] : 0.f;
    entropy_gradient[r] =
        inside && args.entropy_gradient != nullptr ? args.entropy_gradient[at] : 0.f;
  }
}

// products[a][c] += <rows_{4 ty + a}, keys_{tx + 16 c}> over the first `width` columns of two
// [64][D + 1] tiles: the thread's 4 x 4 pairs of S (Q against K) or dP (dO against V).
template <int D>
__device__ __forceinline__ void tile_products(float (&products)[4][4], const float* rows,
                                              const float* keys, int width) {
  constexpr int kLd = D + 1;
  const int ty = static_cast<int>(threadIdx.x) / 16, tx = static_cast<int>(threadIdx.x) % 16;
  for (int k = 0; k < width; ++k) {
    float q[4], key[4];
#pragma unroll
    for (int a = 0; a < 4; ++a) q[a] = rows[(4 * ty + a) * kLd + k];
#pragma unroll
    for (int c = 0; c < 4; ++c) key[c] = keys[(tx + 16 * c) * kLd + k];
#pragma unroll
    for (int a = 0; a < 4; ++a) {
#pragma unroll
      for (int c = 0; c < 4; ++c) products[a][c] = fmaf(q[a], key[c], products[a][c]);
    }
  }
}

// The pair terms of the thread's 4 x 4 pairs (rows 4 ty + a of the query tile at m0, keys
// tx + 16 c of the key tile at n0): p and dS into the shared [64][65] arrays, and the sum of
// dS_ij <q_i, k_j> over them returned. Q, dO in `rows_q`, `rows_do`; K, V in `keys_k`, `keys_v`.
template <int D>
__device__ __forceinline__ float pair_terms(const SdpaBackwardArgs& args, const Shared<D>& s,
                                            const float* rows_q, const float* rows_do,
                                            const float* keys_k, const float* keys_v,
                                            const CloudView& view, int m0, int n0) {
  const int ty = static_cast<int>(threadIdx.x) / 16, tx = static_cast<int>(threadIdx.x) % 16;
  float raw[4][4] = {}, dp[4][4] = {};
  tile_products<D>(raw, rows_q, keys_k, args.rank);
  tile_products<D>(dp, rows_do, keys_v, args.value_rank);
  float scale_term = 0.f;
#pragma unroll
  for (int a = 0; a < 4; ++a) {
    const int i = 4 * ty + a;
    int first = 0, last = 0;
    visible_keys(args.mask, view, m0 + i, &first, &last);
    const float lse = s.lse[i], term = s.term[i], dh = s.entropy_gradient[i];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int j = tx + 16 * c;
      const bool visible = n0 + j >= first && n0 + j < last;
      const float score = args.scale * raw[a][c];
      const float p = visible ? expf(score - lse) : 0.f;
      const float ds = p * (dp[a][c] - dh * score - term);
      s.weights[i * kPairLd + j] = p;
      s.score_gradients[i * kPairLd + j] = ds;
      scale_term = fmaf(ds, raw[a][c], scale_term);
    }
  }
  return scale_term;
}

// The query tiles of one cloud whose rows can see a key of [n0, n0 + 64): the visible keys of a
// tile's first row and of its last real row bound those of every row (the mask rule is monotone).
__device__ __forceinline__ bool tile_sees(const KernelMask& mask, const CloudView& view, int m0,
                                          int n0) {
  if (m0 >= view.query_length) return false;
  int first = 0, last = 0, unused = 0;
  visible_keys(mask, view, m0, &first, &unused);
  visible_keys(mask, view, min(view.query_length, m0 + kTile) - 1, &unused, &last);
  return first < n0 + kTile && last > n0 && first < last;
}

// The 64 keys a block of a keys kernel owns (blocks run key tile fastest, then b Hkv + g): the
// tile's first key, the cloud and kv head, the query heads [first_head, end_head) that share the
// kv head, the row of the tile's cloud in K and V, and the cloud's lengths.
struct KeyBlock {
  int n0 = 0;
  int b = 0;
  int first_head = 0, end_head = 0;
  std::size_t key_base = 0;
  CloudView view;
};

__device__ __forceinline__ KeyBlock key_block(const SdpaBackwardArgs& args) {
  const int key_tiles = (args.tokens + kTile - 1) / kTile;
  const int set = static_cast<int>(blockIdx.x / static_cast<unsigned>(key_tiles));  // b Hkv + g
  const int group = args.heads / args.kv_heads;
  KeyBlock block;
  block.n0 = static_cast<int>(blockIdx.x % static_cast<unsigned>(key_tiles)) * kTile;
  block.b = set / args.kv_heads;
  block.first_head = (set % args.kv_heads) * group;
  block.end_head = block.first_head + group;
  block.key_base = static_cast<std::size_t>(set) * args.tokens;
  block.view = cloud_view(args.mask, block.b, args.tokens, args.queries);
  return block;
}

// The row of query head h's first query of the cloud b in Q, dO and the row terms. Args:
// SdpaBackwardArgs or SdpaForwardArgs.
template <class Args>
__device__ __forceinline__ std::size_t query_base(const Args& args, int b, int h) {
  return (static_cast<std::size_t>(b) * args.heads + h) * args.queries;
}

// The 64 queries a block of a queries kernel owns (query tile fastest, then b Hq + h): the tile's
// first query, the cloud, the rows of its queries, of its kv head's keys and of its key bias
// terms, the cloud's lengths.
struct QueryBlock {
  int m0 = 0;
  std::size_t row_base = 0, key_base = 0, bias_base = 0;
  CloudView view;
};

// Whether the arrays are (heads, batch, ...) rather than (batch, heads, ...): the forward's
// factored layout (SdpaForwardArgs::heads_major); the backward's are batch-major.
__device__ __forceinline__ bool heads_major(const SdpaBackwardArgs&) { return false; }
__device__ __forceinline__ bool heads_major(const SdpaForwardArgs& args) {
  return args.heads_major;
}

template <class Args>
__device__ __forceinline__ QueryBlock query_block(const Args& args) {
  const int query_tiles = (args.queries + kTile - 1) / kTile;
  const int row_set = static_cast<int>(blockIdx.x / static_cast<unsigned>(query_tiles));
  const int b = row_set / args.heads, h = row_set % args.heads;
  const int g = h / (args.heads / args.kv_heads);
  const bool by_head = heads_major(args);
  const auto head_set = static_cast<std::size_t>(by_head ? h * args.batch + b : b * args.heads + h);
  QueryBlock block;
  block.m0 = static_cast<int>(blockIdx.x % static_cast<unsigned>(query_tiles)) * kTile;
  block.row_base = head_set * args.queries;
  block.key_base =
      static_cast<std::size_t>(by_head ? g * args.batch + b : b * args.kv_heads + g) * args.tokens;
  block.bias_base = head_set * args.tokens;
  block.view = cloud_view(args.mask, b, args.tokens, args.queries);
  return block;
}

// dQ += dS K over the tile's 64 keys for the thread's rows 4 ty + a and columns tx + 16 c (dS in
// shared memory, K in the [64][D + 1] tile `keys`).
template <int D>
__device__ __forceinline__ void queries_times_keys(float (&dq)[4][D / 16],
                                                   const float* score_gradients,
                                                   const float* keys) {
  const int ty = static_cast<int>(threadIdx.x) / 16, tx = static_cast<int>(threadIdx.x) % 16;
  for (int j = 0; j < kTile; ++j) {
    float ds[4];
#pragma unroll
    for (int a = 0; a < 4; ++a) ds[a] = score_gradients[(4 * ty + a) * kPairLd + j];
#pragma unroll
    for (int c = 0; c < D / 16; ++c) {
      const float key = keys[j * (D + 1) + tx + 16 * c];
#pragma unroll
      for (int a = 0; a < 4; ++a) dq[a][c] = fmaf(ds[a], key, dq[a][c]);
    }
  }
}

// The block's sum of the threads' `term`s in a fixed order (a tree in the shared `sums`, one float
// a thread), written by thread 0 to scale_terms[blockIdx.x]. Every thread of the block calls it.
__device__ __forceinline__ void block_scale_term(float term, float* sums, float* scale_terms) {
  __syncthreads();
  sums[threadIdx.x] = term;
  for (int width = static_cast<int>(blockDim.x) / 2; width > 0; width /= 2) {
    __syncthreads();
    if (static_cast<int>(threadIdx.x) < width) sums[threadIdx.x] += sums[threadIdx.x + width];
  }
  if (threadIdx.x == 0) scale_terms[blockIdx.x] = sums[0];
}

template <int D>
__global__ void __launch_bounds__(kThreads) sdpa_backward_keys_kernel(const SdpaBackwardArgs args) {
  constexpr int kLd = D + 1;
  constexpr int kColumns = D / 16;
  EMFLOW_DYNAMIC_SHARED(storage);
  const Shared<D> s(reinterpret_cast<float*>(storage));
  float* const Qs = s.a;
  float* const dOs = s.b;
  float* const Ks = s.c;
  float* const Vs = s.d;
  const KeyBlock block = key_block(args);
  const int n0 = block.n0;
  const CloudView& view = block.view;
  const std::size_t key_base = block.key_base;
  load_rows<D>(Ks, args.key + key_base * args.rank, n0, view.key_length, args.rank);
  load_rows<D>(Vs, args.value + key_base * args.value_rank, n0, view.key_length, args.value_rank);

  const int ty = static_cast<int>(threadIdx.x) / 16, tx = static_cast<int>(threadIdx.x) % 16;
  float dk[4][kColumns] = {}, dv[4][kColumns] = {};
  float scale_term = 0.f;
  for (int h = block.first_head; h < block.end_head; ++h) {
    const std::size_t row_base = query_base(args, block.b, h);
    for (int m0 = 0; m0 < args.queries; m0 += kTile) {
      if (!tile_sees(args.mask, view, m0, n0)) continue;  // the same for the whole block
      __syncthreads();  // the last tile's rows, weights and score gradients have been read
      load_rows<D>(Qs, args.query + row_base * args.rank, m0, view.query_length, args.rank);
      load_rows<D>(dOs, args.output_gradient + row_base * args.value_rank, m0, view.query_length,
                   args.value_rank);
      load_row_terms(s.lse, s.term, s.entropy_gradient, args, row_base, m0, view.query_length);
      __syncthreads();
      scale_term += pair_terms<D>(args, s, Qs, dOs, Ks, Vs, view, m0, n0);
      __syncthreads();
      if (args.atomic_queries) {  // this tile's share of dQ = scale dS K, added to the rows
        float dq[4][kColumns] = {};
        queries_times_keys<D>(dq, s.score_gradients, Ks);
#pragma unroll
        for (int a = 0; a < 4; ++a) {
          const int i = m0 + 4 * ty + a;
          if (i >= view.query_length) continue;
#pragma unroll
          for (int c = 0; c < kColumns; ++c) {
            const int column = tx + 16 * c;
            if (column < args.rank) {
              atomicAdd(args.query_gradient + (row_base + i) * args.rank + column,
                        args.scale * dq[a][c]);
            }
          }
        }
      }
      // dV += P^T dO and dK += dS^T Q for keys 4 ty + a, columns tx + 16 c.
      for (int i = 0; i < kTile; ++i) {
        float p[4], ds[4];
#pragma unroll
        for (int a = 0; a < 4; ++a) {
          p[a] = s.weights[i * kPairLd + 4 * ty + a];
          ds[a] = s.score_gradients[i * kPairLd + 4 * ty + a];
        }
#pragma unroll
        for (int c = 0; c < kColumns; ++c) {
          const float gradient = dOs[i * kLd + tx + 16 * c], q = Qs[i * kLd + tx + 16 * c];
#pragma unroll
          for (int a = 0; a < 4; ++a) {
            dv[a][c] = fmaf(p[a], gradient, dv[a][c]);
            dk[a][c] = fmaf(ds[a], q, dk[a][c]);
          }
        }
      }
    }
  }
#pragma unroll
  for (int a = 0; a < 4; ++a) {
    const int j = n0 + 4 * ty + a;
    if (j >= args.tokens) continue;
#pragma unroll
    for (int c = 0; c < kColumns; ++c) {
      const int column = tx + 16 * c;
      if (column < args.rank) {
        args.key_gradient[(key_base + j) * args.rank + column] = args.scale * dk[a][c];
      }
      if (column < args.value_rank) {
        args.value_gradient[(key_base + j) * args.value_rank + column] = dv[a][c];
      }
    }
  }
  if (args.atomic_queries && args.scale_terms != nullptr) {
    block_scale_term(scale_term, s.weights, args.scale_terms);
  }
}

template <int D>
__global__ void __launch_bounds__(kThreads)
    sdpa_backward_queries_kernel(const SdpaBackwardArgs args) {
  constexpr int kColumns = D / 16;
  EMFLOW_DYNAMIC_SHARED(storage);
  const Shared<D> s(reinterpret_cast<float*>(storage));
  float* const Ks = s.a;
  float* const Vs = s.b;
  float* const Qs = s.c;
  float* const dOs = s.d;
  const QueryBlock block = query_block(args);
  const int m0 = block.m0;
  const CloudView& view = block.view;
  const std::size_t row_base = block.row_base, key_base = block.key_base;
  load_rows<D>(Qs, args.query + row_base * args.rank, m0, view.query_length, args.rank);
  load_rows<D>(dOs, args.output_gradient + row_base * args.value_rank, m0, view.query_length,
               args.value_rank);
  load_row_terms(s.lse, s.term, s.entropy_gradient, args, row_base, m0, view.query_length);

  const int ty = static_cast<int>(threadIdx.x) / 16, tx = static_cast<int>(threadIdx.x) % 16;
  float dq[4][kColumns] = {};
  float scale_term = 0.f;
  for (int n0 = 0; n0 < view.key_length; n0 += kTile) {
    if (!tile_sees(args.mask, view, m0, n0)) continue;  // the same for the whole block
    __syncthreads();  // the last key tile and score gradients have been read (and the rows are in)
    load_rows<D>(Ks, args.key + key_base * args.rank, n0, view.key_length, args.rank);
    load_rows<D>(Vs, args.value + key_base * args.value_rank, n0, view.key_length, args.value_rank);
    __syncthreads();
    scale_term += pair_terms<D>(args, s, Qs, dOs, Ks, Vs, view, m0, n0);
    __syncthreads();
    queries_times_keys<D>(dq, s.score_gradients, Ks);
  }
#pragma unroll
  for (int a = 0; a < 4; ++a) {
    const int i = m0 + 4 * ty + a;
    if (i >= args.queries) continue;
#pragma unroll
    for (int c = 0; c < kColumns; ++c) {
      const int column = tx + 16 * c;
      if (column < args.rank) {
        args.query_gradient[(row_base + i) * args.rank + column] = args.scale * dq[a][c];
      }
    }
  }
  if (args.scale_terms != nullptr) block_scale_term(scale_term, s.weights, args.scale_terms);
}

// The forward pass in float32 (SdpaForwardArgs): one block per 64 queries of one head, Q's tile
// in shared memory, the visible key tiles of the kv head in turn; S = scale Q K^T in 4 x 4
// register tiles (rows 4 ty + a, keys tx + 16 c), an online softmax in base 2 per row (its
// maximum over the 16 threads of the row by shuffles), P through shared memory, O += P V in
// registers (rows 4 ty + a, columns tx + 16 c). The sums of a row stay per thread until the end
// and are then added over its 16 threads in a fixed order (the same bits run to run). Shared:
// the backward's layout, Q in a, K in c, V in d, P in weights.
template <int D>
__global__ void __launch_bounds__(kThreads) sdpa_forward_kernel(const SdpaForwardArgs args) {
  constexpr int kLd = D + 1;
  constexpr int kColumns = D / 16;
  constexpr float kLog2e = 1.4426950408889634f, kLn2 = 0.6931471805599453f;
  EMFLOW_DYNAMIC_SHARED(storage);
  const Shared<D> s(reinterpret_cast<float*>(storage));
  float* const Qs = s.a;
  float* const Ks = s.c;
  float* const Vs = s.d;
  const QueryBlock block = query_block(args);
  const int m0 = block.m0;
  const CloudView& view = block.view;
  load_rows<D>(Qs, args.query + block.row_base * args.rank, m0, view.query_length, args.rank);

  const int ty = static_cast<int>(threadIdx.x) / 16, tx = static_cast<int>(threadIdx.x) % 16;
  const float scale2 = args.scale * kLog2e;  // scores in base-2 units
  float row_max[4], row_sum[4], row_moment[4];
  int first[4], last[4];
#pragma unroll
  for (int a = 0; a < 4; ++a) {
    row_max[a] = -INFINITY;
    row_sum[a] = row_moment[a] = 0.f;
    visible_keys(args.mask, view, m0 + 4 * ty + a, &first[a], &last[a]);
  }
  float o[4][kColumns] = {};
  for (int n0 = 0; n0 < view.key_length; n0 += kTile) {
    if (!tile_sees(args.mask, view, m0, n0)) continue;  // the same for the whole block
    __syncthreads();                                    // the previous tile's K, V and P are read
    load_rows<D>(Ks, args.key + block.key_base * args.rank, n0, view.key_length, args.rank);
    load_rows<D>(Vs, args.value + block.key_base * args.value_rank, n0, view.key_length,
                 args.value_rank);
    __syncthreads();
    float t[4][4] = {};
    tile_products<D>(t, Qs, Ks, args.rank);
#pragma unroll
    for (int a = 0; a < 4; ++a) {
      float tile_max = -INFINITY;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int j = n0 + tx + 16 * c;
        const bool visible = j >= first[a] && j < last[a];
        const float bias =
            visible && args.key_bias != nullptr ? args.key_bias[block.bias_base + j] : 0.f;
        t[a][c] = visible ? scale2 * (t[a][c] + bias) : -INFINITY;
        tile_max = fmaxf(tile_max, t[a][c]);
      }
      // Every thread of the warp shuffles (both rows of 16 threads), whatever its row sees.
#pragma unroll
      for (int lane_mask = 8; lane_mask > 0; lane_mask >>= 1) {
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, lane_mask));
      }
      const float new_max = fmaxf(row_max[a], tile_max);
      // The exponent's reference point: 0 while the row has seen no visible key (its weights
      // are then 0), so -inf - -inf never occurs.
      const float reference = new_max == -INFINITY ? 0.f : new_max;
      float rescale = 0.f, shift = 0.f;
      if (row_max[a] != -INFINITY) {
        shift = row_max[a] - reference;  // <= 0
        rescale = exp2f(shift);
      }
      row_moment[a] = rescale * (row_moment[a] + shift * row_sum[a]);
      row_sum[a] *= rescale;
      row_max[a] = new_max;
#pragma unroll
      for (int c = 0; c < kColumns; ++c) o[a][c] *= rescale;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        float weight = 0.f;
        if (t[a][c] != -INFINITY) {
          const float centred = t[a][c] - reference;
          weight = exp2f(centred);
          row_sum[a] += weight;
          row_moment[a] = fmaf(weight, centred, row_moment[a]);
        }
        s.weights[(4 * ty + a) * kPairLd + tx + 16 * c] = weight;
      }
    }
    __syncthreads();  // P visible; a row's weights come from the 16 threads of its half-warp
    for (int j = 0; j < kTile; ++j) {
      float p[4];
#pragma unroll
      for (int a = 0; a < 4; ++a) p[a] = s.weights[(4 * ty + a) * kPairLd + j];
#pragma unroll
      for (int c = 0; c < kColumns; ++c) {
        const float v = Vs[j * kLd + tx + 16 * c];
#pragma unroll
        for (int a = 0; a < 4; ++a) o[a][c] = fmaf(p[a], v, o[a][c]);
      }
    }
  }
  // The rows' sums over their 16 threads (a fixed shuffle order), then normalised and written.
#pragma unroll
  for (int a = 0; a < 4; ++a) {
#pragma unroll
    for (int lane_mask = 8; lane_mask > 0; lane_mask >>= 1) {
      row_sum[a] += __shfl_xor_sync(0xffffffffu, row_sum[a], lane_mask);
      row_moment[a] += __shfl_xor_sync(0xffffffffu, row_moment[a], lane_mask);
    }
  }
#pragma unroll
  for (int a = 0; a < 4; ++a) {
    const int i = m0 + 4 * ty + a;
    if (i >= args.queries) continue;
    // A row that sees a key has its largest weight 1 in the sum: a sum that is not > 0 comes
    // from a NaN or infinite score, whose weights are undefined (NaN, docs/MATH.md §6.6).
    const bool any_key = first[a] < last[a];
    const bool defined = row_sum[a] > 0.f;
    const float inverse = defined ? 1.f / row_sum[a] : NAN;
    const std::size_t row = block.row_base + static_cast<std::size_t>(i);
    float* const out = args.output + row * args.value_rank;
#pragma unroll
    for (int c = 0; c < kColumns; ++c) {
      const int column = tx + 16 * c;
      if (column < args.value_rank) out[column] = any_key ? o[a][c] * inverse : 0.f;
    }
    if (tx == 0) {
      const float log2_sum = defined ? log2f(row_sum[a]) : NAN;
      args.lse[row] = any_key ? (row_max[a] + log2_sum) * kLn2 : -INFINITY;
      if (args.entropy != nullptr) {
        args.entropy[row] = any_key ? kLn2 * (log2_sum - row_moment[a] * inverse) : 0.f;
      }
    }
  }
}

template <int D>
void allow(const char* operation) {
  const int bytes = static_cast<int>(BackwardLayout<D>::bytes);
  check_cuda(cudaFuncSetAttribute(sdpa_backward_keys_kernel<D>,
                                  cudaFuncAttributeMaxDynamicSharedMemorySize, bytes),
             operation, "cudaFuncSetAttribute(sdpa_backward_keys_kernel)");
  check_cuda(cudaFuncSetAttribute(sdpa_backward_queries_kernel<D>,
                                  cudaFuncAttributeMaxDynamicSharedMemorySize, bytes),
             operation, "cudaFuncSetAttribute(sdpa_backward_queries_kernel)");
}

template <int D>
void allow_forward(const char* operation) {
  check_cuda(
      cudaFuncSetAttribute(sdpa_forward_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(BackwardLayout<D>::bytes)),
      operation, "cudaFuncSetAttribute(sdpa_forward_kernel)");
}

template <int D>
void launch_forward_width(const SdpaForwardArgs& args, cudaStream_t stream, const char* operation) {
  const unsigned query_blocks = static_cast<unsigned>((args.queries + kTile - 1) / kTile) *
                                static_cast<unsigned>(args.heads) *
                                static_cast<unsigned>(args.batch);
  launch(operation, "sdpa_forward_kernel", sdpa_forward_kernel<D>, query_blocks, kThreads,
         BackwardLayout<D>::bytes, stream, args);
}

template <int D>
void launch_width(const SdpaBackwardArgs& args, cudaStream_t stream, const char* operation) {
  const std::size_t bytes = BackwardLayout<D>::bytes;
  const unsigned key_blocks = static_cast<unsigned>((args.tokens + kTile - 1) / kTile) *
                              static_cast<unsigned>(args.kv_heads) *
                              static_cast<unsigned>(args.batch);
  launch(operation, "sdpa_backward_keys_kernel", sdpa_backward_keys_kernel<D>, key_blocks, kThreads,
         bytes, stream, args);
  if (args.atomic_queries) return;  // dQ and the scale terms came with dK and dV
  const unsigned query_blocks = static_cast<unsigned>((args.queries + kTile - 1) / kTile) *
                                static_cast<unsigned>(args.heads) *
                                static_cast<unsigned>(args.batch);
  launch(operation, "sdpa_backward_queries_kernel", sdpa_backward_queries_kernel<D>, query_blocks,
         kThreads, bytes, stream, args);
}

// --- Version 2: the five products on the tensor cores (bfloat16 and float16 storage) ----------
//
// The same two kernels, tiles and skipping as above, with Q, K, V and dO held in shared memory
// in the storage type ([64][D + 8]: rows of a multiple of 16 bytes, shifted by 16 bytes from one
// row to the next, so that ldmatrix's eight rows fall in distinct banks) and the products on
// mma.sync m16n8k16 (kernels/mma.cuh) with float32 accumulators. Four warps a block, each owning
// 16 of the tile's 64 keys (the keys kernel) or queries (the queries kernel):
//   keys kernel, per query tile: S^T = K Q^T and dP^T = V dO^T (16 x 64 per warp, accumulators),
//       P^T and dS^T formed in those registers, then dV += P^T dO and dK += dS^T Q with P^T and
//       dS^T rounded to the storage type as the A operand (mma::accumulators_to_a): the scores
//       never leave registers;
//   queries kernel, per key tile: S = Q K^T and dP = dO V^T, dS in registers, dQ += dS K.
// The atomics mode (SdpaBackwardArgs::atomic_queries; the float32 keys kernel has it too): the
// keys kernel also writes dS^T (rounded) to shared memory and each warp forms dQ += dS K for 16
// of the tile's queries (A from dS^T by ldmatrix.trans, mma::load_a_trans_ldsm), added to the
// float32 dQ by atomicAdd; the queries kernel is not launched.
// dO arrives in float32 from the row terms' kernel (zero on rows that see no key) and is rounded
// to the storage type it came from (exact). Rounding P and dS to 16 bits before their products
// is FlashAttention's; the gradients are held to the 16-bit rule of docs/MATH.md §8.8.
// Version 1 of this form: plain loads into shared memory (no cp.async pipeline), one block of
// 128 threads per tile; never run on a GPU (checked under the CPU emulation of CUDA).

constexpr int kTcThreads = 128;

constexpr int kPairTcLd = kTile + 8;  // dS^T of the atomics mode, [64][72]

template <class T, int D>
struct TcLayout {
  static constexpr int ld = D + 8;
  static constexpr std::size_t tile = static_cast<std::size_t>(kTile) * ld;  // elements
  static constexpr std::size_t pairs = static_cast<std::size_t>(kTile) * kPairTcLd;
  static constexpr std::size_t bytes =
      (4 * tile + pairs) * sizeof(T) + 3 * kTile * sizeof(float) + 2 * kTile * sizeof(int);
};
static_assert(TcLayout<bfloat16, kSdpaBackwardMaxRank>::bytes <= 227 * 1024, "shared memory");

template <class T, int D>
struct TcShared {
  T *a, *b, *c, *d;                      // [64][D + 8] each
  T* pairs;                              // dS^T, [64][72] (the keys kernel's atomics mode)
  float *lse, *term, *entropy_gradient;  // per row of the query tile
  int *first, *last;                     // the visible keys of each row of the query tile

  __device__ explicit TcShared(void* base) {
    using L = TcLayout<T, D>;
    a = static_cast<T*>(base);
    b = a + L::tile;
    c = b + L::tile;
    d = c + L::tile;
    pairs = d + L::tile;
    lse = reinterpret_cast<float*>(pairs + L::pairs);
    term = lse + kTile;
    entropy_gradient = term + kTile;
    first = reinterpret_cast<int*>(entropy_gradient + kTile);
    last = first + kTile;
  }
};

// Rows [row0, row0 + 64) of a (rows x width) row-major matrix of S (T, or float rounded once to
// T) into a [64][D + 8] tile of T, zero beyond `valid` rows and beyond `width` columns.
template <class T, int D, class S>
__device__ __forceinline__ void load_tile(T* dst, const S* src, int row0, int valid, int width) {
  for (int index = static_cast<int>(threadIdx.x); index < kTile * D; index += kTcThreads) {
    const int r = index / D, c = index % D;
    float v = 0.f;
    if (row0 + r < valid && c < width)
      v = widen(src[static_cast<std::size_t>(row0 + r) * width + c]);
    store(dst + r * (D + 8) + c, v);
  }
}

// The 16-wide steps of a product over `width` columns (zero beyond it in the tiles).
__device__ __forceinline__ int steps16(int width) { return (width + 15) / 16 * 16; }

// The 16 x 64 product of the warp's 16 rows (`rows`) with the tile's 64 rows (`columns`) as
// B^T, over `steps` columns (a multiple of 16): acc[n] gets columns 8 n .. 8 n + 7.
template <class T, int D>
__device__ __forceinline__ void rows_times_tile(mma::FragC (&acc)[8], const T* rows,
                                                const T* columns, int steps) {
  constexpr int kLd = D + 8;
  for (int k = 0; k < steps; k += 16) {
    const mma::FragA a = mma::load_a_ldsm(rows + k, kLd);
#pragma unroll
    for (int n = 0; n < 8; n += 2) {
      mma::FragB b0, b1;
      mma::load_b_col_pair_ldsm(columns + n * 8 * kLd + k, kLd, b0, b1);
      mma::mma_16816<T>(acc[n], a, b0);
      mma::mma_16816<T>(acc[n + 1], a, b1);
    }
  }
}

// acc (16 x D) += A B, with A the 16 x 16 operand `a` and B the 16 rows of the tile at `rows`
// (rows down k, D columns).
template <class T, int D>
__device__ __forceinline__ void accumulate_rows(mma::FragC (&acc)[D / 8], const mma::FragA& a,
                                                const T* rows) {
#pragma unroll
  for (int c = 0; c < D / 8; c += 2) {
    mma::FragB b0, b1;
    mma::load_b_row_pair_ldsm(rows + c * 8, D + 8, b0, b1);
    mma::mma_16816<T>(acc[c], a, b0);
    mma::mma_16816<T>(acc[c + 1], a, b1);
  }
}

template <class T, int D>
__global__ void __launch_bounds__(kTcThreads)
    sdpa_backward_keys_tc_kernel(const SdpaBackwardArgs args, const T* query, const T* key,
                                 const T* value) {
  constexpr int kLd = D + 8;
  constexpr int kOut = D / 8;  // 8-column accumulator tiles of dK and dV
  EMFLOW_DYNAMIC_SHARED(storage);
  const TcShared<T, D> s(storage);
  T* const Qs = s.a;
  T* const dOs = s.b;
  T* const Ks = s.c;
  T* const Vs = s.d;
  const KeyBlock block = key_block(args);
  const int n0 = block.n0;
  const CloudView& view = block.view;
  const std::size_t key_base = block.key_base;
  load_tile<T, D>(Ks, key + key_base * args.rank, n0, view.key_length, args.rank);
  load_tile<T, D>(Vs, value + key_base * args.value_rank, n0, view.key_length, args.value_rank);

  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int g = mma::lane_group(), t = mma::lane_in_group();
  const int rank_steps = steps16(args.rank), value_steps = steps16(args.value_rank);
  const T* const my_keys = Ks + warp * 16 * kLd;
  const T* const my_values = Vs + warp * 16 * kLd;
  mma::FragC dk[kOut] = {}, dv[kOut] = {};
  float scale_term = 0.f;
  for (int h = block.first_head; h < block.end_head; ++h) {
    const std::size_t row_base = query_base(args, block.b, h);
    for (int m0 = 0; m0 < args.queries; m0 += kTile) {
      if (!tile_sees(args.mask, view, m0, n0)) continue;  // the same for the whole block
      __syncthreads();                                    // the last tile's rows have been read
      load_tile<T, D>(Qs, query + row_base * args.rank, m0, view.query_length, args.rank);
      load_tile<T, D>(dOs, args.output_gradient + row_base * args.value_rank, m0, view.query_length,
                      args.value_rank);
      load_row_terms(s.lse, s.term, s.entropy_gradient, args, row_base, m0, view.query_length);
      if (static_cast<int>(threadIdx.x) < kTile) {
        const int i = static_cast<int>(threadIdx.x);
        visible_keys(args.mask, view, m0 + i, &s.first[i], &s.last[i]);
      }
      __syncthreads();
      // S^T = K Q^T and dP^T = V dO^T for the warp's 16 keys and the tile's 64 queries.
      mma::FragC st[8] = {}, dpt[8] = {};
      rows_times_tile<T, D>(st, my_keys, Qs, rank_steps);
      rows_times_tile<T, D>(dpt, my_values, dOs, value_steps);
      // P^T and dS^T in place: accumulator x[e] is key g + 8 (e / 2) of the warp's 16, query
      // 8 n + 2 t + e % 2 of the tile.
#pragma unroll
      for (int n = 0; n < 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int j = n0 + warp * 16 + g + 8 * (e / 2);
          const int i = 8 * n + 2 * t + e % 2;
          const bool visible = j >= s.first[i] && j < s.last[i];
          const float score = args.scale * st[n].x[e];
          const float p = visible ? expf(score - s.lse[i]) : 0.f;
          const float ds = p * (dpt[n].x[e] - s.entropy_gradient[i] * score - s.term[i]);
          scale_term = fmaf(ds, st[n].x[e], scale_term);
          dpt[n].x[e] = ds;
          st[n].x[e] = p;
          if (args.atomic_queries) {
            store(s.pairs + (warp * 16 + g + 8 * (e / 2)) * kPairTcLd + i, ds);
          }
        }
      }
      // dV += P^T dO and dK += dS^T Q, the 64 queries in four steps of 16.
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const mma::FragA p = mma::accumulators_to_a<T>(st[2 * kk], st[2 * kk + 1]);
        accumulate_rows<T, D>(dv, p, dOs + kk * 16 * kLd);
        const mma::FragA ds = mma::accumulators_to_a<T>(dpt[2 * kk], dpt[2 * kk + 1]);
        accumulate_rows<T, D>(dk, ds, Qs + kk * 16 * kLd);
      }
      if (args.atomic_queries) {
        // This tile's share of dQ = scale dS K, added to the rows: warp w takes queries
        // 16 w .. 16 w + 15 against the 64 keys (dS from its transpose in shared memory, the
        // rounded values the products above read), 16 columns at a time.
        __syncthreads();  // every warp's dS^T is in
        const int row0 = warp * 16;
        for (int c = 0; c < kOut; c += 2) {
          mma::FragC dq[2] = {};
#pragma unroll
          for (int kk = 0; kk < 4; ++kk) {
            const mma::FragA a =
                mma::load_a_trans_ldsm(s.pairs + kk * 16 * kPairTcLd + row0, kPairTcLd);
            mma::FragB b0, b1;
            mma::load_b_row_pair_ldsm(Ks + kk * 16 * kLd + c * 8, kLd, b0, b1);
            mma::mma_16816<T>(dq[0], a, b0);
            mma::mma_16816<T>(dq[1], a, b1);
          }
#pragma unroll
          for (int half = 0; half < 2; ++half) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int i = m0 + row0 + g + 8 * (e / 2);
              const int column = 8 * (c + half) + 2 * t + e % 2;
              if (i < view.query_length && column < args.rank) {
                atomicAdd(args.query_gradient + (row_base + i) * args.rank + column,
                          args.scale * dq[half].x[e]);
              }
            }
          }
        }
      }
    }
  }
#pragma unroll
  for (int c = 0; c < kOut; ++c) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int j = n0 + warp * 16 + g + 8 * (e / 2);
      const int column = 8 * c + 2 * t + e % 2;
      if (j >= args.tokens) continue;
      if (column < args.rank) {
        args.key_gradient[(key_base + j) * args.rank + column] = args.scale * dk[c].x[e];
      }
      if (column < args.value_rank) {
        args.value_gradient[(key_base + j) * args.value_rank + column] = dv[c].x[e];
      }
    }
  }
  if (args.atomic_queries && args.scale_terms != nullptr) {
    block_scale_term(scale_term, reinterpret_cast<float*>(s.a), args.scale_terms);
  }
}

template <class T, int D>
__global__ void __launch_bounds__(kTcThreads)
    sdpa_backward_queries_tc_kernel(const SdpaBackwardArgs args, const T* query, const T* key,
                                    const T* value) {
  constexpr int kLd = D + 8;
  constexpr int kOut = D / 8;  // 8-column accumulator tiles of dQ
  EMFLOW_DYNAMIC_SHARED(storage);
  const TcShared<T, D> s(storage);
  T* const Ks = s.a;
  T* const Vs = s.b;
  T* const Qs = s.c;
  T* const dOs = s.d;
  const QueryBlock block = query_block(args);
  const int m0 = block.m0;
  const CloudView& view = block.view;
  const std::size_t row_base = block.row_base, key_base = block.key_base;
  load_tile<T, D>(Qs, query + row_base * args.rank, m0, view.query_length, args.rank);
  load_tile<T, D>(dOs, args.output_gradient + row_base * args.value_rank, m0, view.query_length,
                  args.value_rank);

  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int g = mma::lane_group(), t = mma::lane_in_group();
  // The lane's two rows of the tile, g and g + 8 of the warp's 16: their terms and visible keys.
  float lse[2], term[2], dh[2];
  int first[2], last[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = m0 + warp * 16 + g + 8 * r;
    const bool inside = i < view.query_length;
    const std::size_t at = row_base + static_cast<std::size_t>(inside ? i : 0);
    lse[r] = inside ? args.lse[at] : 0.f;
    term[r] = inside ? args.row_term[at] : 0.f;
    dh[r] = inside && args.entropy_gradient != nullptr ? args.entropy_gradient[at] : 0.f;
    visible_keys(args.mask, view, i, &first[r], &last[r]);
  }
  const int rank_steps = steps16(args.rank), value_steps = steps16(args.value_rank);
  const T* const my_queries = Qs + warp * 16 * kLd;
  const T* const my_gradients = dOs + warp * 16 * kLd;
  mma::FragC dq[kOut] = {};
  float scale_term = 0.f;
  for (int n0 = 0; n0 < view.key_length; n0 += kTile) {
    if (!tile_sees(args.mask, view, m0, n0)) continue;  // the same for the whole block
    __syncthreads();  // the last key tile has been read (and the rows are in)
    load_tile<T, D>(Ks, key + key_base * args.rank, n0, view.key_length, args.rank);
    load_tile<T, D>(Vs, value + key_base * args.value_rank, n0, view.key_length, args.value_rank);
    __syncthreads();
    // S = Q K^T and dP = dO V^T for the warp's 16 queries and the tile's 64 keys.
    mma::FragC sc[8] = {}, dp[8] = {};
    rows_times_tile<T, D>(sc, my_queries, Ks, rank_steps);
    rows_times_tile<T, D>(dp, my_gradients, Vs, value_steps);
    // dS in place of dP: accumulator x[e] is row g + 8 (e / 2), key 8 n + 2 t + e % 2.
#pragma unroll
    for (int n = 0; n < 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e / 2;
        const int j = n0 + 8 * n + 2 * t + e % 2;
        const bool visible = j >= first[r] && j < last[r];
        const float raw = sc[n].x[e];
        const float score = args.scale * raw;
        const float p = visible ? expf(score - lse[r]) : 0.f;
        const float ds = p * (dp[n].x[e] - dh[r] * score - term[r]);
        dp[n].x[e] = ds;
        scale_term = fmaf(ds, raw, scale_term);
      }
    }
    // dQ += dS K, the 64 keys in four steps of 16.
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      const mma::FragA ds = mma::accumulators_to_a<T>(dp[2 * kk], dp[2 * kk + 1]);
      accumulate_rows<T, D>(dq, ds, Ks + kk * 16 * kLd);
    }
  }
#pragma unroll
  for (int c = 0; c < kOut; ++c) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = m0 + warp * 16 + g + 8 * (e / 2);
      const int column = 8 * c + 2 * t + e % 2;
      if (i < args.queries && column < args.rank) {
        args.query_gradient[(row_base + i) * args.rank + column] = args.scale * dq[c].x[e];
      }
    }
  }
  if (args.scale_terms != nullptr) {
    block_scale_term(scale_term, reinterpret_cast<float*>(s.a), args.scale_terms);
  }
}

template <class T, int D>
void allow_tc(const char* operation) {
  const int bytes = static_cast<int>(TcLayout<T, D>::bytes);
  check_cuda(cudaFuncSetAttribute(sdpa_backward_keys_tc_kernel<T, D>,
                                  cudaFuncAttributeMaxDynamicSharedMemorySize, bytes),
             operation, "cudaFuncSetAttribute(sdpa_backward_keys_tc_kernel)");
  check_cuda(cudaFuncSetAttribute(sdpa_backward_queries_tc_kernel<T, D>,
                                  cudaFuncAttributeMaxDynamicSharedMemorySize, bytes),
             operation, "cudaFuncSetAttribute(sdpa_backward_queries_tc_kernel)");
}

template <class T, int D>
void launch_tc_width(const SdpaBackwardArgs& args, const T* query, const T* key, const T* value,
                     cudaStream_t stream, const char* operation) {
  const std::size_t bytes = TcLayout<T, D>::bytes;
  const unsigned key_blocks = static_cast<unsigned>((args.tokens + kTile - 1) / kTile) *
                              static_cast<unsigned>(args.kv_heads) *
                              static_cast<unsigned>(args.batch);
  launch(operation, "sdpa_backward_keys_tc_kernel", sdpa_backward_keys_tc_kernel<T, D>, key_blocks,
         kTcThreads, bytes, stream, args, query, key, value);
  if (args.atomic_queries) return;  // dQ and the scale terms came with dK and dV
  const unsigned query_blocks = static_cast<unsigned>((args.queries + kTile - 1) / kTile) *
                                static_cast<unsigned>(args.heads) *
                                static_cast<unsigned>(args.batch);
  launch(operation, "sdpa_backward_queries_tc_kernel", sdpa_backward_queries_tc_kernel<T, D>,
         query_blocks, kTcThreads, bytes, stream, args, query, key, value);
}

template <class T>
__global__ void sdpa_row_terms_kernel(const SdpaRowTermsArgs<T> args) {
  const long long rows = static_cast<long long>(args.batch) * args.heads * args.queries;
  const long long row = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row >= rows) return;
  const int i = static_cast<int>(row % args.queries);
  const int b = static_cast<int>(row / (static_cast<long long>(args.queries) * args.heads));
  const int rv = args.value_rank;
  float* dO = args.output_gradient32 + row * rv;
  if (!sees_a_key(args.mask, b, args.tokens, args.queries, i)) {
    for (int a = 0; a < rv; ++a) dO[a] = 0.f;
    args.lse32[row] = 0.f;
    args.row_term[row] = 0.f;
    if (args.entropy_gradient32 != nullptr) args.entropy_gradient32[row] = 0.f;
    return;
  }
  double e = 0.0;
  if (args.output_gradient != nullptr) {
    for (int a = 0; a < rv; ++a) {
      dO[a] = widen(args.output_gradient[row * rv + a]);
      e += static_cast<double>(dO[a]) * static_cast<double>(widen(args.output[row * rv + a]));
    }
  } else {
    for (int a = 0; a < rv; ++a) dO[a] = 0.f;
  }
  if (args.lse_gradient != nullptr) e -= static_cast<double>(args.lse_gradient[row]);
  if (args.entropy_gradient != nullptr) {
    args.entropy_gradient32[row] = args.entropy_gradient[row];
    e += static_cast<double>(args.entropy_gradient[row]) *
         (static_cast<double>(args.entropy[row]) - static_cast<double>(args.lse[row]));
  }
  args.lse32[row] = args.lse[row];
  args.row_term[row] = static_cast<float>(e);
}

__global__ void sdpa_scale_sum_kernel(const float* terms, int count, double* sum) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  double total = 0.0;
  for (int k = 0; k < count; ++k) total += static_cast<double>(terms[k]);
  *sum = total;
}

template <class T>
__global__ void narrow_kernel(const float* in, T* out, long long count) {
  const long long e = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e < count) store(out + e, in[e]);
}

constexpr unsigned kElementThreads = 256;

unsigned element_blocks(long long count) {
  return static_cast<unsigned>((count + kElementThreads - 1) / kElementThreads);
}

}  // namespace

template <class T>
void launch_sdpa_row_terms(const SdpaRowTermsArgs<T>& args, cudaStream_t stream,
                           const char* operation) {
  const long long rows = static_cast<long long>(args.batch) * args.heads * args.queries;
  launch(operation, "sdpa_row_terms_kernel", sdpa_row_terms_kernel<T>, element_blocks(rows),
         kElementThreads, 0, stream, args);
}

void launch_sdpa_scale_sum(const float* terms, int count, double* sum, cudaStream_t stream,
                           const char* operation) {
  launch(operation, "sdpa_scale_sum_kernel", sdpa_scale_sum_kernel, 1u, 32u, 0, stream, terms,
         count, sum);
}

template <class T>
void launch_narrow(const float* in, T* out, std::size_t count, cudaStream_t stream,
                   const char* operation) {
  if (count == 0) return;
  const auto n = static_cast<long long>(count);
  launch(operation, "narrow_kernel", narrow_kernel<T>, element_blocks(n), kElementThreads, 0,
         stream, in, out, n);
}

template void launch_sdpa_row_terms<float>(const SdpaRowTermsArgs<float>&, cudaStream_t,
                                           const char*);
template void launch_sdpa_row_terms<bfloat16>(const SdpaRowTermsArgs<bfloat16>&, cudaStream_t,
                                              const char*);
template void launch_sdpa_row_terms<float16>(const SdpaRowTermsArgs<float16>&, cudaStream_t,
                                             const char*);
template void launch_narrow<bfloat16>(const float*, bfloat16*, std::size_t, cudaStream_t,
                                      const char*);
template void launch_narrow<float16>(const float*, float16*, std::size_t, cudaStream_t,
                                     const char*);

std::size_t sdpa_backward_shared_bytes(int width) {
  return width <= 64 ? BackwardLayout<64>::bytes : BackwardLayout<128>::bytes;
}

void prepare_sdpa_backward(int width, const char* operation) {
  if (width <= 64) {
    allow<64>(operation);
  } else {
    allow<128>(operation);
  }
}

void launch_sdpa_backward(const SdpaBackwardArgs& args, cudaStream_t stream,
                          const char* operation) {
  const int width = args.rank > args.value_rank ? args.rank : args.value_rank;
  if (width <= 64) {
    launch_width<64>(args, stream, operation);
  } else {
    launch_width<128>(args, stream, operation);
  }
}

void prepare_sdpa_forward(int width, const char* operation) {
  if (width <= 64) {
    allow_forward<64>(operation);
  } else {
    allow_forward<128>(operation);
  }
}

void launch_sdpa_forward(const SdpaForwardArgs& args, cudaStream_t stream, const char* operation) {
  const int width = args.rank > args.value_rank ? args.rank : args.value_rank;
  if (width <= 64) {
    launch_forward_width<64>(args, stream, operation);
  } else {
    launch_forward_width<128>(args, stream, operation);
  }
}

template <class T>
void prepare_sdpa_backward_tc(int width, const char* operation) {
  if (width <= 64) {
    allow_tc<T, 64>(operation);
  } else {
    allow_tc<T, 128>(operation);
  }
}

template <class T>
void launch_sdpa_backward_tc(const SdpaBackwardArgs& args, const T* query, const T* key,
                             const T* value, cudaStream_t stream, const char* operation) {
  const int width = args.rank > args.value_rank ? args.rank : args.value_rank;
  if (width <= 64) {
    launch_tc_width<T, 64>(args, query, key, value, stream, operation);
  } else {
    launch_tc_width<T, 128>(args, query, key, value, stream, operation);
  }
}

#define EMFLOW_SDPA_BACKWARD_TC(T)                                                                \
  template void prepare_sdpa_backward_tc<T>(int, const char*);                                    \
  template void launch_sdpa_backward_tc<T>(const SdpaBackwardArgs&, const T*, const T*, const T*, \
                                           cudaStream_t, const char*);
EMFLOW_SDPA_BACKWARD_TC(bfloat16)
EMFLOW_SDPA_BACKWARD_TC(float16)
#undef EMFLOW_SDPA_BACKWARD_TC

}  // namespace emflow::detail
