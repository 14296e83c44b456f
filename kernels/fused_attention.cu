// Fused EMF attention in float32: per cloud b, head h and block of 64 queries,
//
//   o_i = sum_j softmax_j(<q_i, x_j>) c_j,   q_i = beta log2(e) (M_h^T y_i + u_h),   c_j = F_h x_j,
//
// for queries y_i (the cloud itself for self-attention) against the keys x_j of the cloud,

// streaming 64-key tiles of the cloud X (the keys) and of C through shared memory with an online
// softmax in base 2 (exp2f; log2(e) is folded into q by the GEMM that forms it, so a score costs
// one FFMA chain and the exponent one subtraction). The N x N matrix is never stored.
//
// Kernels:
//   fused_attention_kernel<64|128|256>  the attention itself; the template argument is the
//       head-dim tile, the true dim is a run-time value <= tile (zero-padded in shared memory).
//   sum_heads_kernel  adds the per-head partial updates in head order, plus the offset, so the
//       result is bitwise identical run to run (no atomics anywhere).
//
// Key splits (flash-decoding): with args.splits > 1 the grid holds one block per query block and
// split of args.split_keys keys, each writing the partial state over its keys (partial.hpp) to
// its own slice of args.out; key_splits.cu merges them in split order.
//
// Layout of one block (256 threads = 16 x 16; thread (ty, tx)):
//   scores: rows ty*4 + i (i < 4), keys tx + 16 j (j < 4): a 4 x 4 register tile; the 16 threads
//     sharing a row are one half-warp, so row max and row sums are half-warp shuffles.
//   update: rows ty*4 + i, columns 64 c + tx*4 + e (c < tile/64, e < 4): tile/4 accumulators.
//   shared memory: Qs[64][tile+4] (queries), KVs[64][tile+4] (the key tile, then the content
//     tile), Ps[64][64+4] (probabilities, transposed: Ps[key][query]). Rows are padded by 4 floats
//     so float4 accesses stay aligned and a half-warp's 16 rows fall in distinct bank groups.
//
// Masks: key tiles wholly outside the block's visible band (beyond L_b, above the causal
// diagonal, before the window, outside the block's split) are skipped; inside a tile each score
// is masked individually. A warp whose 8 query rows are all padding (beyond the query length:
// a decoding block of 1 real query has 7 such warps) skips the arithmetic, though it still helps
// load the tiles.
// A row with no visible key so far keeps max = -inf; the reference point for exp2 is then 0 and
// the rescale factor 0, so no -inf - -inf appears. A NaN score is dropped by fmaxf but not by
// the weights: 2^(NaN - m) makes the row's sum NaN (and stays NaN through every rescale), which
// the end of the kernel turns into NaN outputs; no score is tested for NaN. Entropy is tracked
// online as a = sum_j w_j (t_j - m) (w_j = 2^(t_j - m)), rescaled with the max:
// H = ln2 (log2 Z - a / Z).
//
// History: version 1 is the straightforward register-tiled FFMA kernel; it has been checked on
// the CPU emulation (tests/cuda/emulation) but not yet run or timed on a GPU. Tuning candidates
// once it can be timed: cp.async double buffering of the next key and content tiles (separate K
// and V buffers) and 8 x 4 score tiles per thread. Version 1.1 (this one) removes the spills:
// the score loop over the columns is no longer unrolled by 2 (see there).
//
// ptxas -v (sm_90, nvcc 13, the build's flags: -O3 -lineinfo --expt-relaxed-constexpr), per tile
// 64 / 128 / 256, under __launch_bounds__(256, 2) at 64 and 128 and (256, 1) at 256:
//   before (1.0)  registers 128 / 128 / 255, spill stores 36 / 24 / 12 bytes (loads 56 / 48 / 24)
//   after (1.1)   registers 128 / 128 / 255, no spills, no stack frame
// Dynamic shared memory (ptxas reports none static): 51, 83 and 147 KiB a block
// (FusedLayout: Qs, KVs [64][tile + 4], Ps [64][68] floats).
// The bounds are kept rather than loosened: at tiles 64 and 128, 128 registers x 256 threads is
// half the SM's 64K registers, so two blocks (16 warps) fit, and shared memory allows 4 and 2
// (228 KiB an SM); a looser bound would let ptxas take more registers and cost the second block.
// Prediction for the H200 (132 SMs), never measured: occupancy 2 blocks an SM at tiles 64 and
// 128 (264 blocks a wave), 1 at 256 (registers and shared memory both; 132 a wave), as before;
// the spill traffic removed was a few local loads per key tile per thread, through L1, so the
// gain is expected to be small (0 to 5 %), mostly at tile 64, where the score loop is shortest.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "attention_kernels.hpp"
#include "cuda/cuda_support.hpp"
#include "launch.cuh"
#include "mask.cuh"

namespace emflow::detail {

namespace {

constexpr int kThreads = 256;
constexpr int kBlockQueries = kFusedBlockQueries;
constexpr int kBlockKeys = kFusedBlockKeys;
constexpr int kProbabilityRow = kBlockQueries + 4;
constexpr float kLn2 = 0.693147180559945309f;

template <int Tile>
struct FusedLayout {
  static constexpr int row = Tile + 4;  // floats per padded row of Qs and KVs
  static constexpr std::size_t floats = static_cast<std::size_t>(kBlockQueries + kBlockKeys) * row +
                                        static_cast<std::size_t>(kBlockKeys) * kProbabilityRow;
  static constexpr std::size_t bytes = floats * sizeof(float);
};

// Copies rows [row0, row0 + 64) of a (rows x dim) row-major matrix into a [64][Tile+4] shared
// tile, zero-filling columns >= dim and rows >= rows. `vector_loads`: dim % 4 == 0 and `src` is
// 16-byte aligned, so whole float4s can be read.
// Which split, cloud, head and query block a block computes.
struct BlockPlace {
  int split, cloud, head, query_block;
};

__device__ __forceinline__ BlockPlace block_place(const FusedAttentionArgs& args,
                                                  int query_blocks) {
  const unsigned per_split = static_cast<unsigned>(query_blocks) *
                             static_cast<unsigned>(args.heads) * static_cast<unsigned>(args.batch);
  const unsigned in_split = blockIdx.x % per_split;
  const int block_in_head = static_cast<int>(in_split % static_cast<unsigned>(query_blocks));
  const int cloud_head = static_cast<int>(in_split / static_cast<unsigned>(query_blocks));
  BlockPlace place;
  place.split = static_cast<int>(blockIdx.x / per_split);
  place.cloud = cloud_head / args.heads;
  place.head = cloud_head % args.heads;
  place.query_block = query_blocks - 1 - block_in_head;
  return place;
}

template <int Tile>
__device__ __forceinline__ void load_tile(float* __restrict__ dst, const float* __restrict__ src,
                                          int row0, int rows, int dim, bool vector_loads) {
  constexpr int kRow = FusedLayout<Tile>::row;
  if (vector_loads) {
    constexpr int kPerRow = Tile / 4;
    constexpr int kSteps = kBlockKeys * kPerRow / kThreads;
#pragma unroll
    for (int step = 0; step < kSteps; ++step) {
      const int index = static_cast<int>(threadIdx.x) + step * kThreads;
      const int r = index / kPerRow;
      const int col = (index % kPerRow) * 4;
      float4 value = make_float4(0.f, 0.f, 0.f, 0.f);
      if (row0 + r < rows && col < dim) {
        value =
            *reinterpret_cast<const float4*>(src + static_cast<std::size_t>(row0 + r) * dim + col);
      }
      *reinterpret_cast<float4*>(dst + r * kRow + col) = value;
    }
  } else {
    constexpr int kSteps = kBlockKeys * Tile / kThreads;
#pragma unroll 8
    for (int step = 0; step < kSteps; ++step) {
      const int index = static_cast<int>(threadIdx.x) + step * kThreads;
      const int r = index / Tile;
      const int col = index % Tile;
      float value = 0.f;
      if (row0 + r < rows && col < dim) value = src[static_cast<std::size_t>(row0 + r) * dim + col];
      dst[r * kRow + col] = value;
    }
  }
}

// Two blocks per SM at tiles 64 and 128 (at most 128 registers a thread), one at 256.
template <int Tile>
__global__ void __launch_bounds__(kThreads, Tile < 256 ? 2 : 1)
    fused_attention_kernel(const FusedAttentionArgs args, int query_blocks, bool vector_loads) {
  constexpr int kRow = FusedLayout<Tile>::row;
  constexpr int kChunks = Tile / 64;  // 64-column chunks of the update a thread accumulates
  EMFLOW_DYNAMIC_SHARED(shared_storage);
  float* const Qs = reinterpret_cast<float*>(shared_storage);
  float* const KVs = Qs + kBlockQueries * kRow;
  float* const Ps = KVs + kBlockKeys * kRow;

  const int tx = static_cast<int>(threadIdx.x) & 15;
  const int ty = static_cast<int>(threadIdx.x) >> 4;
  // Query blocks of one (cloud, head) are adjacent in launch order (their key and content tiles
  // share L2), and the last query blocks, which see the most keys under a causal mask, go first.
  // Splits of the keys are the slowest index.
  const BlockPlace place = block_place(args, query_blocks);
  const int split = place.split;
  const int h = place.head;
  const int b = place.cloud;
  const int query_block = place.query_block;
  const int N = args.tokens;
  const int Nq = args.queries;
  const int dim = args.dim;
  const int m0 = query_block * kBlockQueries;
  const CloudView view = cloud_view(args.mask, b, N, Nq);
  const int length = view.key_length;
  const int split_first = split * args.split_keys;
  const int split_last = min(N, split_first + args.split_keys);

  const std::size_t head_cloud = static_cast<std::size_t>(h) * args.batch + b;
  const float* const query = args.query + head_cloud * static_cast<std::size_t>(Nq) * dim;
  const float* const content = args.content + head_cloud * static_cast<std::size_t>(N) * dim;
  const float* const keys = args.cloud + static_cast<std::size_t>(b) * N * dim;

  // Key tiles that can hold a visible key for some query of this block: [first_key, last_key),
  // from the block's first and last real query (visible intervals only grow with the query),
  // within the block's split.
  int last_key = 0;
  int first_key = 0;
  if (m0 < view.query_length) {
    int unused = 0;
    visible_keys(args.mask, view, m0, &first_key, &unused);
    visible_keys(args.mask, view, min(view.query_length, m0 + kBlockQueries) - 1, &unused,
                 &last_key);
  }
  first_key = max(first_key, split_first);
  last_key = min(last_key, split_last);
  first_key = (first_key / kBlockKeys) * kBlockKeys;
  const int dim_padded = (dim + 3) & ~3;  // the tiles are zero beyond dim
  // Warp w holds the rows m0 + 8 w ... m0 + 8 w + 7 (ty = 2 w, 2 w + 1); the condition is the
  // same for every lane, so the shuffles below run with the whole warp or not at all.
  const bool warp_active = m0 + 8 * (static_cast<int>(threadIdx.x) >> 5) < view.query_length;

  // The visible keys [row_first, row_last) of the thread's 4 query rows in this split.
  int row_first[4], row_last[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    visible_keys(args.mask, view, m0 + ty * 4 + i, &row_first[i], &row_last[i]);
    row_first[i] = max(row_first[i], split_first);
    row_last[i] = max(row_first[i], min(row_last[i], split_last));
  }

  float row_max[4], row_sum[4], row_moment[4];
  float acc[4][kChunks * 4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    row_max[i] = -INFINITY;
    row_sum[i] = 0.f;
    row_moment[i] = 0.f;
#pragma unroll
    for (int e = 0; e < kChunks * 4; ++e) acc[i][e] = 0.f;
  }

  load_tile<Tile>(Qs, query, m0, Nq, dim, vector_loads);

  for (int n0 = first_key; n0 < last_key; n0 += kBlockKeys) {
    __syncthreads();  // the previous tile's content and probabilities have been read
    // Rows past the key length are zero-filled: padding tokens may hold anything, even NaN.
    load_tile<Tile>(KVs, keys, n0, length, dim, vector_loads);
    __syncthreads();  // key tile (and, on the first pass, the queries) in place

    // t_ij = <q_i, x_j> in base-2 units.
    if (warp_active) {
      float t[4][4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) t[i][j] = 0.f;
      }
      // One step of 4 columns at a time: 8 float4 loads (32 registers) feed 64 FMAs. Unrolling
      // by 2 kept two steps' operands live (64 registers) and spilled at 128 registers a thread;
      // the ratio of loads to FMAs is the same either way, and the SM's other 15 warps hide the
      // load latency that the second step would have covered.
#pragma unroll 1
      for (int k = 0; k < dim_padded; k += 4) {
        float4 q[4], x[4];
#pragma unroll
        for (int i = 0; i < 4; ++i)
          q[i] = *reinterpret_cast<const float4*>(Qs + (ty * 4 + i) * kRow + k);
#pragma unroll
        for (int j = 0; j < 4; ++j)
          x[j] = *reinterpret_cast<const float4*>(KVs + (tx + 16 * j) * kRow + k);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            t[i][j] = fmaf(q[i].x, x[j].x, t[i][j]);
            t[i][j] = fmaf(q[i].y, x[j].y, t[i][j]);
            t[i][j] = fmaf(q[i].z, x[j].z, t[i][j]);
            t[i][j] = fmaf(q[i].w, x[j].w, t[i][j]);
          }
        }
      }

      // Mask, then the online softmax update of each of the thread's 4 rows.
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float tile_max = -INFINITY;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int key = n0 + tx + 16 * j;
          if (key < row_first[i] || key >= row_last[i]) t[i][j] = -INFINITY;
          tile_max = fmaxf(tile_max, t[i][j]);
        }
#pragma unroll
        for (int lane_mask = 8; lane_mask > 0; lane_mask >>= 1) {
          tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, lane_mask));
        }
        const float new_max = fmaxf(row_max[i], tile_max);
        // Reference point of the exponent: 0 while the row has seen no visible key (all its
        // weights are then 0), so -inf - -inf never occurs.
        const float reference = new_max == -INFINITY ? 0.f : new_max;
        float rescale = 0.f;
        float shift = 0.f;
        if (row_max[i] != -INFINITY) {
          shift = row_max[i] - reference;  // <= 0
          rescale = exp2f(shift);
        }
        row_moment[i] = rescale * (row_moment[i] + shift * row_sum[i]);
        row_sum[i] *= rescale;
        row_max[i] = new_max;
#pragma unroll
        for (int e = 0; e < kChunks * 4; ++e) acc[i][e] *= rescale;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          float weight = 0.f;
          if (t[i][j] != -INFINITY) {
            const float centred = t[i][j] - reference;
            weight = exp2f(centred);
            row_sum[i] += weight;
            row_moment[i] = fmaf(weight, centred, row_moment[i]);
          }
          t[i][j] = weight;
        }
      }
      // Probabilities (unnormalised), transposed so the update loop reads 4 query rows at once.
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        *reinterpret_cast<float4*>(Ps + (tx + 16 * j) * kProbabilityRow + ty * 4) =
            make_float4(t[0][j], t[1][j], t[2][j], t[3][j]);
      }
    }
    __syncthreads();  // every thread is done with the key tile; probabilities visible
    load_tile<Tile>(KVs, content, n0, length, dim, vector_loads);
    __syncthreads();  // content tile in place

    // acc += P C over the tile's 64 keys (masked and missing keys have weight 0, content 0).
    // A row's probabilities were written by the threads of its own half-warp.
    if (!warp_active) continue;
#pragma unroll 4
    for (int n = 0; n < kBlockKeys; ++n) {
      const float4 p = *reinterpret_cast<const float4*>(Ps + n * kProbabilityRow + ty * 4);
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        if (c * 64 < dim) {
          const float4 v = *reinterpret_cast<const float4*>(KVs + n * kRow + c * 64 + tx * 4);
          const float pr[4] = {p.x, p.y, p.z, p.w};
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            acc[i][c * 4 + 0] = fmaf(pr[i], v.x, acc[i][c * 4 + 0]);
            acc[i][c * 4 + 1] = fmaf(pr[i], v.y, acc[i][c * 4 + 1]);
            acc[i][c * 4 + 2] = fmaf(pr[i], v.z, acc[i][c * 4 + 2]);
            acc[i][c * 4 + 3] = fmaf(pr[i], v.w, acc[i][c * 4 + 3]);
          }
        }
      }
    }
  }

  // Row totals over the half-warp (fixed shuffle order: deterministic), then normalise and write.
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int lane_mask = 8; lane_mask > 0; lane_mask >>= 1) {
      row_sum[i] += __shfl_xor_sync(0xffffffffu, row_sum[i], lane_mask);
      row_moment[i] += __shfl_xor_sync(0xffffffffu, row_moment[i], lane_mask);
    }
  }
  const bool add_offset = args.offset != nullptr && args.heads == 1;
  const HeadRows& target = args.out;
  // Where the block writes, recomputed from the block index here rather than kept in registers
  // through the key loop.
  const BlockPlace at = block_place(args, query_blocks);
  const std::size_t row_base =
      at.split * target.split_rows + at.cloud * target.batch_stride + at.head * target.head_stride;
  const std::size_t stat_base = at.split * target.split_stats +
                                (static_cast<std::size_t>(at.cloud) * args.heads + at.head) * Nq;
  const int m_first = at.query_block * kBlockQueries;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int qi = m_first + ty * 4 + i;
    if (qi >= Nq) continue;
    // A real query always sees a key. Its max key alone contributes 1 to the sum, so a sum that
    // is not > 0 is NaN (a NaN or +inf score: NaN weights) or 0 (every visible score -inf):
    // the weights are undefined and lse, entropy and the update are NaN (docs/MATH.md §6.6).
    // Padding queries are written as 0 whatever their accumulators hold (0 * NaN content).
    // A partial state (partial.hpp) keeps the all -inf case apart, since a later merge with a
    // finite score defines it: lse = -inf, H = NaN and o = the contents times their weight 0.
    const bool any_key = row_first[i] < row_last[i];
    const bool defined = row_sum[i] > 0.f;
    const bool unweighted = args.partial_state && row_sum[i] == 0.f;
    const float inverse = defined ? 1.f / row_sum[i] : (unweighted ? 1.f : NAN);
    float* const out = target.rows + row_base + static_cast<std::size_t>(qi) * dim;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = c * 64 + tx * 4 + e;
        if (col < dim) {
          float value = any_key ? acc[i][c * 4 + e] * inverse : 0.f;
          if (add_offset && any_key) value += args.offset[col];
          out[col] = value;
        }
      }
    }
    if (tx == 0) {
      const std::size_t stat = stat_base + qi;
      const float log2_sum = defined ? log2f(row_sum[i]) : NAN;
      if (target.lse != nullptr) {
        target.lse[stat] = any_key && !unweighted ? (row_max[i] + log2_sum) * kLn2 : -INFINITY;
      }
      if (target.entropy != nullptr) {
        target.entropy[stat] = any_key ? kLn2 * (log2_sum - row_moment[i] * inverse) : 0.f;
      }
    }
  }
}

__global__ void sum_heads_kernel(const float* __restrict__ partial,
                                 const float* __restrict__ offset, float* __restrict__ update,
                                 int batch, int heads, int tokens, int queries, int dim,
                                 KernelMask mask) {
  const std::size_t total = static_cast<std::size_t>(batch) * queries * dim;
  for_each_token_element(batch, queries, dim, [&](std::size_t index, int b, int i, int a) {
    float value = 0.f;
    for (int h = 0; h < heads; ++h) value += partial[static_cast<std::size_t>(h) * total + index];
    if (offset != nullptr && sees_a_key(mask, b, tokens, queries, i)) value += offset[a];
    update[index] = value;
  });
}

// The kernel's dynamic shared memory beyond the default 48 KiB must be allowed on each device
// before its first launch there (prepare_fused_attention, called by the plan that launches it).
// The setting belongs to the device's context: not cached here, since cudaDeviceReset clears it.
template <int Tile>
void allow_shared_memory(const char* operation) {
  check_cuda(cudaFuncSetAttribute(fused_attention_kernel<Tile>,
                                  cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(FusedLayout<Tile>::bytes)),
             operation, "cudaFuncSetAttribute(fused_attention_kernel)");
}

template <int Tile>
void launch_tile(const FusedAttentionArgs& args, cudaStream_t stream, const char* operation) {
  const std::size_t bytes = FusedLayout<Tile>::bytes;
  const int query_blocks = (args.queries + kBlockQueries - 1) / kBlockQueries;
  const unsigned blocks = static_cast<unsigned>(query_blocks) * static_cast<unsigned>(args.heads) *
                          static_cast<unsigned>(args.batch) * static_cast<unsigned>(args.splits);
  const bool vector_loads = args.dim % 4 == 0 &&
                            reinterpret_cast<std::uintptr_t>(args.cloud) % 16 == 0 &&
                            reinterpret_cast<std::uintptr_t>(args.query) % 16 == 0 &&
                            reinterpret_cast<std::uintptr_t>(args.content) % 16 == 0;
  launch(operation, "fused_attention_kernel", fused_attention_kernel<Tile>, blocks, kThreads, bytes,
         stream, args, query_blocks, vector_loads);
}

}  // namespace

std::size_t fused_shared_bytes(int dim) {
  if (dim <= 64) return FusedLayout<64>::bytes;
  if (dim <= 128) return FusedLayout<128>::bytes;
  return FusedLayout<256>::bytes;
}

void prepare_fused_attention(int dim, const char* operation) {
  if (dim <= 64) {
    allow_shared_memory<64>(operation);
  } else if (dim <= 128) {
    allow_shared_memory<128>(operation);
  } else {
    allow_shared_memory<256>(operation);
  }
}

void launch_fused_attention(const FusedAttentionArgs& args, cudaStream_t stream,
                            const char* operation) {
  if (args.dim <= 64) {
    launch_tile<64>(args, stream, operation);
  } else if (args.dim <= 128) {
    launch_tile<128>(args, stream, operation);
  } else {
    launch_tile<256>(args, stream, operation);
  }
}

void launch_sum_heads(const float* partial, const float* offset, float* update, int batch,
                      int heads, int tokens, int queries, int dim, const KernelMask& mask,
                      cudaStream_t stream, const char* operation) {
  const std::size_t total = static_cast<std::size_t>(batch) * queries * dim;
  const unsigned blocks = grid_for(static_cast<std::int64_t>(total));
  launch(operation, "sum_heads_kernel", sum_heads_kernel, blocks, 256, 0, stream, partial, offset,
         update, batch, heads, tokens, queries, dim, mask);
}

}  // namespace emflow::detail
