// The bfloat16 path of the CPU backend on processors with AVX512-BF16 (docs/MATH.md §7): the
// score and content products of the fused attention by vdpbf16ps, two bf16 products per float32
// lane and instruction, accumulated in float32; the projections, the online softmax and every
// statistic in float32.
//
// Operands, per cloud and head, rounded to bfloat16 once:
//   queries t_i = M_h^T x_i + u_h          pairs of coordinates in one 32-bit word
//   keys    x_j                            per tile of 32 keys: [pair][key], so one vector
//                                          holds one coordinate pair of 16 keys
//   values  c_j = F_h x_j                  per pair of keys: [key pair][column]
// and, per tile, the unnormalised weights exp(s_ij - m_i) rounded to bfloat16, whose adjacent
// keys form the pairs of the P V product. These are the roundings of the naive kernel of the
// accuracy rule (docs/MATH.md §7.4), so the error is of its order.
//
// One OpenMP region per call (phased_tasks.hpp): per cloud, the packing of the keys and contents
// in tasks of 256 keys, then the query blocks of 64 rows, each projecting its own queries; tasks
// are claimed from one counter, and the only waits (blocks for the packing, the last tasks for
// each other) sleep instead of spinning, since on a shared machine a spinning thread takes the
// CPU time the thread it waits for needs. Every output is computed by one thread in one order,
// so results do not depend on the thread count.
//
// On the avx512bf16 path only (target.hpp); route() sends bfloat16 calls here where
// Machine::avx512_bf16.
#include <immintrin.h>
#include <omp.h>

// GCC 12's AVX-512 reductions start from _mm512_undefined_ps(), which -Wmaybe-uninitialized
// reports inside every caller: a false positive of the intrinsic headers.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

#include "avx512_bf16.hpp"
#include "core/backends.hpp"
#include "core/parallel.hpp"
#include "core/queries.hpp"
#include "engine.hpp"
#include "phased_tasks.hpp"
#include "simd.hpp"
#include "target.hpp"

#if EMFLOW_CPU_AVX512BF16  // the avx512bf16 path only

EMFLOW_CPU_BEGIN

namespace {

constexpr std::int64_t kTile = 32;   // keys per tile
constexpr std::int64_t kRows = 8;    // query rows per score tile
constexpr std::int64_t kBlock = 64;  // query rows per task
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

std::uint32_t pair_of(float a, float b) {
  return static_cast<std::uint32_t>(to_bfloat16(a).bits) |
         static_cast<std::uint32_t>(to_bfloat16(b).bits) << 16;
}

/// S[kRows x 32] = beta Q[kRows rows] K_tile (pairs coordinate pairs).
void score_tile(const std::uint32_t* q, std::int64_t pairs, const std::uint32_t* panel, float beta,
                float* scores) {
  __m512 acc[kRows][2];
  for (int r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (std::int64_t k = 0; k < pairs; ++k) {
    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(panel + k * kTile);
    const __m512bh k1 = (__m512bh)_mm512_loadu_si512(panel + k * kTile + 16);
    for (int r = 0; r < kRows; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(q[r * pairs + k]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, k0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, k1);
    }
  }
  const __m512 scale = _mm512_set1_ps(beta);
  for (int r = 0; r < kRows; ++r) {
    _mm512_storeu_ps(scores + r * kTile, _mm512_mul_ps(scale, acc[r][0]));
    _mm512_storeu_ps(scores + r * kTile + 16, _mm512_mul_ps(scale, acc[r][1]));
  }
}

/// O[4 rows x 64 columns] += P[4 rows, 16 key pairs] V[16 key pairs x 64 columns].
template <int V>
void content_tile(const std::uint32_t* p, const std::uint32_t* values, std::int64_t columns,
                  float* o, std::int64_t ldo) {
  __m512 acc[4][V];
  for (int r = 0; r < 4; ++r) {
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_loadu_ps(o + r * ldo + v * 16);
  }
  for (int t = 0; t < kTile / 2; ++t) {
    __m512bh b[V];
    for (int v = 0; v < V; ++v) {
      b[v] = (__m512bh)_mm512_loadu_si512(values + t * columns + v * 16);
    }
    for (int r = 0; r < 4; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(p[r * (kTile / 2) + t]));
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a, b[v]);
    }
  }
  for (int r = 0; r < 4; ++r) {
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(o + r * ldo + v * 16, acc[r][v]);
  }
}

void content_rows(const std::uint32_t* p, const std::uint32_t* values, std::int64_t columns,
                  float* o, std::int64_t ldo) {
  for (std::int64_t c = 0; c < columns; c += 64) {
    const std::int64_t v = std::min<std::int64_t>(4, (columns - c) / 16);
    const std::uint32_t* vv = values + c;
    if (v == 4) {
      content_tile<4>(p, vv, columns, o + c, ldo);
    } else if (v == 3) {
      content_tile<3>(p, vv, columns, o + c, ldo);
    } else if (v == 2) {
      content_tile<2>(p, vv, columns, o + c, ldo);
    } else {
      content_tile<1>(p, vv, columns, o + c, ldo);
    }
  }
}

/// The online-softmax state of the rows of a block: per row the running max, and per lane the
/// sums Z and E of the engine (engine.cpp).
struct BlockState {
  float max[kBlock];
  __m512 sums[kBlock], entropy[kBlock];
  KeyRange keys[kBlock];
};

/// Rows [c, c + kRows) of a block on the key tile at key0: masks a partial tile, updates the
/// state, rescales O where the max grows, and writes the weights exp(s - m) rounded to bfloat16
/// (adjacent keys paired) to `weights`.
void softmax_tile(float* scores, std::int64_t c, std::int64_t key0, BlockState& st, float* o,
                  std::int64_t columns, std::uint32_t* weights) {
  for (int r = 0; r < kRows; ++r) {
    const std::int64_t row_index = c + r;
    float* row = scores + r * kTile;
    const KeyRange keys = st.keys[row_index];
    if (keys.first > key0 || keys.last < key0 + kTile) {
      for (std::int64_t jj = 0; jj < kTile; ++jj) {
        if (!keys.contains(key0 + jj)) row[jj] = kNegInf;
      }
    }
    const __m512 s0 = _mm512_load_ps(row), s1 = _mm512_load_ps(row + 16);
    float& mx = st.max[row_index];
    // Most tiles do not raise the running max: one vector compare instead of a reduction.
    const __m512 tile = _mm512_max_ps(s0, s1);
    if (_mm512_cmp_ps_mask(tile, _mm512_set1_ps(mx), _CMP_GT_OQ) != 0) {
      const float tile_max = _mm512_reduce_max_ps(tile);
      if (mx != kNegInf) {
        const __m512 alpha = _mm512_set1_ps(std::exp(mx - tile_max));
        const __m512 shift = _mm512_set1_ps(mx - tile_max);
        st.entropy[row_index] =
            _mm512_mul_ps(alpha, _mm512_fmadd_ps(shift, st.sums[row_index], st.entropy[row_index]));
        st.sums[row_index] = _mm512_mul_ps(alpha, st.sums[row_index]);
        float* orow = o + row_index * columns;
        for (std::int64_t a = 0; a < columns; a += 16) {
          _mm512_storeu_ps(orow + a, _mm512_mul_ps(alpha, _mm512_loadu_ps(orow + a)));
        }
      }
      mx = tile_max;
    }
    if (mx == kNegInf) {
      std::memset(weights + r * (kTile / 2), 0, sizeof(std::uint32_t) * kTile / 2);
      continue;
    }
    const __m512 m = _mm512_set1_ps(mx);
    const __m512 floor_value = _mm512_set1_ps(-1.0e4f);  // keeps 0 * (s - m) finite at -inf
    const __m512 c0 = _mm512_sub_ps(s0, m), c1 = _mm512_sub_ps(s1, m);
    const __m512 w0 = exp_nonpositive_avx512(c0), w1 = exp_nonpositive_avx512(c1);
    const __m512bh packed = _mm512_cvtne2ps_pbh(w1, w0);
    _mm512_storeu_si512(weights + r * (kTile / 2), (__m512i)packed);
    // Z and E from the float32 weights, as the naive kernel of the rule has them: the rounding
    // of a weight to bfloat16 is an error of the content product only.
    st.sums[row_index] = _mm512_add_ps(st.sums[row_index], _mm512_add_ps(w0, w1));
    st.entropy[row_index] =
        _mm512_fmadd_ps(w0, _mm512_max_ps(c0, floor_value),
                        _mm512_fmadd_ps(w1, _mm512_max_ps(c1, floor_value), st.entropy[row_index]));
  }
}

/// The operands of one cloud shared by all its blocks: the keys per tile of 32 keys
/// ([pair][key]) and per head the contents per pair of keys ([key pair][column]), padding keys and
/// columns 0. Left uninitialised here: the packing tasks write every word, in parallel.
struct CloudOperands {
  std::unique_ptr<std::uint32_t[]> panels;
  std::vector<std::unique_ptr<std::uint32_t[]>> values;
};

/// A thread's buffers, allocated once per call before the parallel region (nothing in the
/// region allocates but project_rows' few rows).
struct Scratch {
  std::vector<float> rows;             // projected rows: kChunk x stride (a packing task's)
  std::vector<std::uint32_t> queries;  // a block's queries: kBlock x pairs
  std::vector<float> o, update;        // kBlock x columns, kBlock x d
  std::vector<char> saw;               // kBlock
};

constexpr std::int64_t kChunk = 256;  // keys per packing task (a multiple of kTile)

/// The shape of a call and what every task reads.
struct Call {
  const AttentionInput<float>& in;
  const AttentionOutput<bfloat16>& out;
  const DenseMaps& maps;
  std::int64_t N, d, H, pairs, columns, padded, stride, chunks;
};

/// Packing task `task` of cloud b: keys [j0, j0 + kChunk) of the panels (task / chunks == H) or
/// their contents for head task / chunks; the last chunk also writes the padding to 0.
void pack_chunk(const Call& call, std::int64_t b, std::int64_t task, CloudOperands& ops,
                Scratch& s) {
  const std::int64_t N = call.N, d = call.d, pairs = call.pairs, columns = call.columns;
  const float* X = call.in.cloud + b * N * d;
  const std::int64_t h = task / call.chunks, j0 = (task % call.chunks) * kChunk;
  const std::int64_t count = std::min(kChunk, N - j0);
  const bool last = j0 + kChunk >= N;
  if (h == call.H) {  // the keys, shared by every head
    std::uint32_t* panels = ops.panels.get();
    const std::int64_t end = last ? call.padded : j0 + count;
    for (std::int64_t j = j0; j < end; ++j) {
      const std::int64_t t = j / kTile, jj = j % kTile;
      for (std::int64_t k = 0; k < pairs; ++k) {
        const float lo = j < N ? X[j * d + 2 * k] : 0.0f;
        const float hi = j < N && 2 * k + 1 < d ? X[j * d + 2 * k + 1] : 0.0f;
        panels[(t * pairs + k) * kTile + jj] = pair_of(lo, hi);
      }
    }
    return;
  }
  const std::int64_t stride = call.stride;
  project_rows(X + j0 * d, count, d, call.maps.layer.value_map + h * d * stride, stride,
               s.rows.data());
  std::uint32_t* values = ops.values[static_cast<std::size_t>(h)].get();
  for (std::int64_t i = 0; i < count; i += 2) {
    const float* lo = s.rows.data() + i * stride;
    std::uint32_t* dst = values + (j0 + i) / 2 * columns;
    for (std::int64_t a = 0; a < d; ++a) {
      const float hi = i + 1 < count ? lo[stride + a] : 0.0f;
      dst[a] = pair_of(lo[a], hi);
    }
    std::fill(dst + d, dst + columns, 0u);
  }
  if (last) {
    std::uint32_t* pad = values + (N + 1) / 2 * columns;
    std::fill(pad, values + call.padded / 2 * columns, 0u);
  }
}

/// One query block (rows [i0, i0 + rows)) of cloud b, all heads; projects its own queries and
/// writes update, lse, entropy. Key tiles outside, row chunks inside, so each tile is read once
/// per block.
void attend_rows(const Call& call, std::int64_t b, std::int64_t i0, const QueryRule& rule,
                 const CloudOperands& ops, Scratch& s) {
  const AttentionInput<float>& in = call.in;
  const AttentionOutput<bfloat16>& out = call.out;
  const std::int64_t d = call.d, N = call.N, H = call.H, pairs = call.pairs;
  const std::int64_t columns = call.columns, stride = call.stride;
  const float beta = static_cast<float>(in.beta);
  const std::int64_t rows = std::min(kBlock, N - i0);
  const std::int64_t chunks = (rows + kRows - 1) / kRows;
  const float* X = in.cloud + (b * N + i0) * d;
  std::vector<float>& o = s.o;
  std::fill(s.update.begin(), s.update.end(), 0.0f);
  std::fill(s.saw.begin(), s.saw.end(), 0);
  alignas(64) float scores[kRows * kTile];
  alignas(64) std::uint32_t weights[kRows * kTile / 2];
  BlockState st;
  // The keys any row of the block, and of each chunk of kRows rows, sees. Padding rows (past a
  // query length) see none, so the ends of a chunk's rows do not bound it.
  std::int64_t first = N, last = 0;
  KeyRange chunk_keys[kBlock / kRows];
  for (std::int64_t k = 0; k < kBlock / kRows; ++k) chunk_keys[k] = {N, 0};
  for (std::int64_t r = 0; r < kBlock; ++r) {
    st.keys[r] = r < rows ? rule.keys(i0 + r) : KeyRange{};
    if (!st.keys[r].empty()) {
      KeyRange& chunk = chunk_keys[r / kRows];
      chunk = {std::min(chunk.first, st.keys[r].first), std::max(chunk.last, st.keys[r].last)};
      first = std::min(first, st.keys[r].first);
      last = std::max(last, st.keys[r].last);
    }
  }
  for (std::int64_t h = 0; h < H; ++h) {
    // The block's queries t_i = M_h^T x_i + u_h, rows past the block 0.
    project_rows(X, rows, d, call.maps.layer.query_map + h * d * stride, stride, s.rows.data());
    const float* bias =
        call.maps.layer.query_bias ? call.maps.layer.query_bias + h * stride : nullptr;
    for (std::int64_t i = 0; i < rows; ++i) {
      const float* row = s.rows.data() + i * stride;
      for (std::int64_t k = 0; k < pairs; ++k) {
        const float lo = row[2 * k] + (bias ? bias[2 * k] : 0.0f);
        const float hi = 2 * k + 1 < d ? row[2 * k + 1] + (bias ? bias[2 * k + 1] : 0.0f) : 0.0f;
        s.queries[static_cast<std::size_t>(i * pairs + k)] = pair_of(lo, hi);
      }
    }
    std::fill(s.queries.begin() + rows * pairs, s.queries.end(), 0u);
    const std::uint32_t* values = ops.values[static_cast<std::size_t>(h)].get();
    for (std::int64_t r = 0; r < kBlock; ++r) {
      st.max[r] = kNegInf;
      st.sums[r] = st.entropy[r] = _mm512_setzero_ps();
    }
    std::fill(o.begin(), o.end(), 0.0f);
    for (std::int64_t t = first / kTile; first < last && t * kTile < last; ++t) {
      const std::int64_t key0 = t * kTile;
      const std::uint32_t* panel = ops.panels.get() + t * pairs * kTile;
      const std::uint32_t* v = values + (key0 / 2) * columns;
      for (std::int64_t k = 0; k < chunks; ++k) {
        const std::int64_t c = k * kRows;
        const KeyRange chunk = chunk_keys[k];
        if (key0 >= chunk.last || key0 + kTile <= chunk.first) continue;
        score_tile(s.queries.data() + c * pairs, pairs, panel, beta, scores);
        softmax_tile(scores, c, key0, st, o.data(), columns, weights);
        content_rows(weights, v, columns, o.data() + c * columns, columns);
        content_rows(weights + 4 * (kTile / 2), v, columns, o.data() + (c + 4) * columns, columns);
      }
    }
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t stats = (b * H + h) * N + i0 + r;
      float lse = kNegInf, entropy = 0.0f;
      if (!st.keys[r].empty()) {
        s.saw[static_cast<std::size_t>(r)] = 1;
        const float z = _mm512_reduce_add_ps(st.sums[r]);
        const float log_z = std::log(z);
        lse = st.max[r] + log_z;
        entropy = log_z - _mm512_reduce_add_ps(st.entropy[r]) / z;
        const float inv = 1.0f / z;
        float* u = s.update.data() + r * d;
        for (std::int64_t a = 0; a < d; ++a) {
          u[a] += o[static_cast<std::size_t>(r * columns + a)] * inv;
        }
      }
      if (out.lse) out.lse[stats] = lse;
      if (out.entropy) out.entropy[stats] = entropy;
    }
  }
  for (std::int64_t r = 0; r < rows; ++r) {
    bfloat16* dst = out.update + (b * N + i0 + r) * d;
    for (std::int64_t a = 0; a < d; ++a) {
      float value = 0.0f;
      if (s.saw[static_cast<std::size_t>(r)]) {
        value = s.update[static_cast<std::size_t>(r * d + a)];
        if (in.layer.offset) value += in.layer.offset[a];
      }
      dst[a] = to_bfloat16(value);
    }
  }
}

}  // namespace

EMFLOW_CPU_END

EMFLOW_CPU_BEGIN

void cpu_attend_bf16(const AttentionInput<float>& in, const AttentionOutput<bfloat16>& out,
                     int threads) {
  const std::int64_t B = in.batch, N = in.tokens, d = in.dim, H = in.layer.heads;
  // The maps without beta: beta scales the scores in float32, after the queries are rounded, as
  // in the naive kernel of the rule; folded into the queries it would make every product
  // M_h^T x_i (often exact in bfloat16 at small d) a rounded one.
  AttentionInput<float> unscaled = in;
  unscaled.beta = 1.0;
  const DenseMaps maps(unscaled);
  const Call call{in,
                  out,
                  maps,
                  N,
                  d,
                  H,
                  (d + 1) / 2,
                  (d + 15) / 16 * 16,
                  (N + kTile - 1) / kTile * kTile,
                  padded_columns(d),
                  (N + kChunk - 1) / kChunk};
  const std::vector<QueryRule> rules = self_rules(B, N, in.mask, in.key_lengths);
  const std::int64_t blocks = (N + kBlock - 1) / kBlock;
  // As the float32 engine: a call of under about 4 MFLOP runs on one thread unless told.
  const double work = 4.0 * static_cast<double>(B * H * d) * static_cast<double>(N * N);
  const int team = threads > 0 ? threads : work < 4e6 ? 1 : omp_get_max_threads();

  // One region for the whole call. Phases: 2b packs cloud b into slot b % 2, 2b + 1 attends its
  // blocks; packing b waits for the blocks of b - 2, which read the same slot.
  std::vector<CloudOperands> slots(static_cast<std::size_t>(std::min<std::int64_t>(B, 2)));
  for (CloudOperands& ops : slots) {
    ops.panels.reset(new std::uint32_t[static_cast<std::size_t>(call.padded * call.pairs)]);
    for (std::int64_t h = 0; h < H; ++h) {
      ops.values.emplace_back(
          new std::uint32_t[static_cast<std::size_t>(call.padded / 2 * call.columns)]);
    }
  }
  std::vector<Scratch> scratch(static_cast<std::size_t>(team));
  for (Scratch& s : scratch) {
    s.rows.resize(static_cast<std::size_t>(kChunk * call.stride));
    s.queries.resize(static_cast<std::size_t>(kBlock * call.pairs));
    s.o.resize(static_cast<std::size_t>(kBlock * call.columns));
    s.update.resize(static_cast<std::size_t>(kBlock * d));
    s.saw.resize(static_cast<std::size_t>(kBlock));
  }
  std::vector<std::int64_t> sizes;
  std::vector<int> needs;
  for (std::int64_t b = 0; b < B; ++b) {
    sizes.push_back((H + 1) * call.chunks);
    needs.push_back(b >= 2 ? static_cast<int>(2 * b - 3) : -1);
    sizes.push_back(blocks);
    needs.push_back(static_cast<int>(2 * b));
  }
  PhasedTasks tasks(std::move(sizes), std::move(needs));
  ParallelErrors errors;
#pragma omp parallel num_threads(team)
  {
    Scratch& s = scratch[static_cast<std::size_t>(omp_get_thread_num())];
    for (PhasedTasks::Task task = tasks.next(); task.phase >= 0; task = tasks.next()) {
      const std::int64_t b = task.phase / 2;
      CloudOperands& ops = slots[static_cast<std::size_t>(b % 2)];
      errors.run([&] {
        if (task.phase % 2 == 0) {
          pack_chunk(call, b, task.index, ops, s);
        } else {
          attend_rows(call, b, task.index * kBlock, rules[static_cast<std::size_t>(b)], ops, s);
        }
      });
      tasks.finish(task);
    }
    tasks.wait_all();
  }
  errors.rethrow();
}

EMFLOW_CPU_END

#endif  // EMFLOW_CPU_AVX512BF16
