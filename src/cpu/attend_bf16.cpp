// The bfloat16 path of the CPU backend on processors with AVX512-BF16 (docs/MATH.md §7): the
// score and content products of the fused attention by vdpbf16ps, two bf16 products per float32
// lane and instruction, accumulated in float32; the projections, the online softmax and every
// statistic in float32.
//
// Operands, per cloud and head, rounded to bfloat16 once:
//   queries t_i = beta (M_h^T x_i + u_h)   pairs of coordinates in one 32-bit word
//   keys    x_j                            per tile of 32 keys: [pair][key], so one vector
//                                          holds one coordinate pair of 16 keys
//   values  c_j = F_h x_j                  per pair of keys: [key pair][column]
// and, per tile, the unnormalised weights exp(s_ij - m_i) rounded to bfloat16, whose adjacent
// keys form the pairs of the P V product. These are the roundings of the naive kernel of the
// accuracy rule (docs/MATH.md §7.4), so the error is of its order.
//
// The kernel functions carry __attribute__((target(...))) instead of this file being compiled
// with -mavx512bf16: inline functions and templates of a translation unit compiled for another
// instruction set can be picked by the linker for the whole program, and would then fault on a
// processor without it. The caller checks __builtin_cpu_supports("avx512bf16") first.
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
#include <vector>

#include "core/backends.hpp"
#include "core/queries.hpp"
#include "engine.hpp"

namespace emflow::detail::cpu {

namespace {

#define EMFLOW_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

constexpr std::int64_t kTile = 32;   // keys per tile
constexpr std::int64_t kRows = 8;    // query rows per score tile
constexpr std::int64_t kBlock = 64;  // query rows per task
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

std::int64_t round_up_block(std::int64_t n) { return (n + kBlock - 1) / kBlock * kBlock; }

std::uint32_t pair_of(float a, float b) {
  return static_cast<std::uint32_t>(to_bfloat16(a).bits) |
         static_cast<std::uint32_t>(to_bfloat16(b).bits) << 16;
}

/// The operands of one cloud and head in the layouts above.
struct Operands {
  std::vector<std::uint32_t> queries;  // Nq x pairs
  std::vector<std::uint32_t> values;   // (padded N / 2) x columns
};

/// exp(x) for x <= 0 (and -inf, giving 0), as exp_nonpositive of simd.hpp.
EMFLOW_BF16_TARGET inline __m512 exp_nonpositive(__m512 x) {
  const __m512 lowest = _mm512_set1_ps(-87.33654f);
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, lowest, _CMP_LT_OQ);
  const __m512 xc = _mm512_max_ps(x, lowest);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693359375f), xc);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  const __m512i e =
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  const __m512 result = _mm512_mul_ps(p, _mm512_castsi512_ps(e));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~tiny), result);
}

/// S[kRows x 32] = Q[kRows rows] K_tile (pairs coordinate pairs).
EMFLOW_BF16_TARGET void score_tile(const std::uint32_t* q, std::int64_t pairs,
                                   const std::uint32_t* panel, float* scores) {
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
  for (int r = 0; r < kRows; ++r) {
    _mm512_storeu_ps(scores + r * kTile, acc[r][0]);
    _mm512_storeu_ps(scores + r * kTile + 16, acc[r][1]);
  }
}

/// O[4 rows x 64 columns] += P[4 rows, 16 key pairs] V[16 key pairs x 64 columns].
template <int V>
EMFLOW_BF16_TARGET void content_tile(const std::uint32_t* p, const std::uint32_t* values,
                                     std::int64_t columns, float* o, std::int64_t ldo) {
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

EMFLOW_BF16_TARGET void content_rows(const std::uint32_t* p, const std::uint32_t* values,
                                     std::int64_t columns, float* o, std::int64_t ldo) {
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
EMFLOW_BF16_TARGET void softmax_tile(float* scores, std::int64_t c, std::int64_t key0,
                                     BlockState& st, float* o, std::int64_t columns,
                                     std::uint32_t* weights) {
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
    const __m512bh packed = _mm512_cvtne2ps_pbh(exp_nonpositive(c1), exp_nonpositive(c0));
    _mm512_storeu_si512(weights + r * (kTile / 2), (__m512i)packed);
    // Z and E from the rounded weights, the ones the content product uses.
    const __m512 w0 = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256((__m512i)packed)), 16));
    const __m512 w1 = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64((__m512i)packed, 1)), 16));
    st.sums[row_index] = _mm512_add_ps(st.sums[row_index], _mm512_add_ps(w0, w1));
    st.entropy[row_index] =
        _mm512_fmadd_ps(w0, _mm512_max_ps(c0, floor_value),
                        _mm512_fmadd_ps(w1, _mm512_max_ps(c1, floor_value), st.entropy[row_index]));
  }
}

/// One query block (rows [i0, i0 + rows)) of cloud b, all heads; writes update, lse, entropy.
/// Key tiles outside, row chunks inside, so each tile is read once per block.
EMFLOW_BF16_TARGET void attend_rows(std::int64_t b, std::int64_t i0, std::int64_t rows,
                                    const AttentionInput<float>& in, const QueryRule& rule,
                                    const std::vector<std::uint32_t>& panels,
                                    const std::vector<Operands>& heads, std::int64_t pairs,
                                    std::int64_t columns, const AttentionOutput<bfloat16>& out) {
  const std::int64_t d = in.dim, N = in.tokens, H = in.layer.heads;
  const std::int64_t chunks = (rows + kRows - 1) / kRows;
  std::vector<float> o(static_cast<std::size_t>(kBlock * columns)),
      update(static_cast<std::size_t>(rows * d), 0.0f);
  alignas(64) float scores[kRows * kTile];
  alignas(64) std::uint32_t weights[kRows * kTile / 2];
  std::vector<char> saw(static_cast<std::size_t>(rows), 0);
  BlockState st;
  std::int64_t first = N, last = 0;
  for (std::int64_t r = 0; r < kBlock; ++r) {
    st.keys[r] = r < rows ? rule.keys(i0 + r) : KeyRange{};
    if (!st.keys[r].empty()) {
      first = std::min(first, st.keys[r].first);
      last = std::max(last, st.keys[r].last);
    }
  }
  for (std::int64_t h = 0; h < H; ++h) {
    const Operands& op = heads[static_cast<std::size_t>(h)];
    for (std::int64_t r = 0; r < kBlock; ++r) {
      st.max[r] = kNegInf;
      st.sums[r] = st.entropy[r] = _mm512_setzero_ps();
    }
    std::fill(o.begin(), o.end(), 0.0f);
    for (std::int64_t t = first / kTile; first < last && t * kTile < last; ++t) {
      const std::int64_t key0 = t * kTile;
      const std::uint32_t* panel = panels.data() + t * pairs * kTile;
      const std::uint32_t* v = op.values.data() + (key0 / 2) * columns;
      for (std::int64_t k = 0; k < chunks; ++k) {
        const std::int64_t c = k * kRows;
        // Rows see growing key ranges: the chunk meets this tile unless it lies outside all.
        const KeyRange top = st.keys[c];
        const KeyRange bottom = st.keys[std::min(c + kRows, rows) - 1];
        const std::int64_t lo = top.empty() ? bottom.first : top.first;
        if (bottom.empty() || key0 >= bottom.last || key0 + kTile <= lo) continue;
        score_tile(op.queries.data() + (i0 + c) * pairs, pairs, panel, scores);
        softmax_tile(scores, c, key0, st, o.data(), columns, weights);
        content_rows(weights, v, columns, o.data() + c * columns, columns);
        content_rows(weights + 4 * (kTile / 2), v, columns, o.data() + (c + 4) * columns, columns);
      }
    }
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t stats = (b * H + h) * N + i0 + r;
      float lse = kNegInf, entropy = 0.0f;
      if (!st.keys[r].empty()) {
        saw[static_cast<std::size_t>(r)] = 1;
        const float z = _mm512_reduce_add_ps(st.sums[r]);
        const float log_z = std::log(z);
        lse = st.max[r] + log_z;
        entropy = log_z - _mm512_reduce_add_ps(st.entropy[r]) / z;
        const float inv = 1.0f / z;
        float* u = update.data() + r * d;
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
      if (saw[static_cast<std::size_t>(r)]) {
        value = update[static_cast<std::size_t>(r * d + a)];
        if (in.layer.offset) value += in.layer.offset[a];
      }
      dst[a] = to_bfloat16(value);
    }
  }
}

}  // namespace

}  // namespace emflow::detail::cpu

namespace emflow::detail {

bool cpu_bf16_available() {
  static const bool available = __builtin_cpu_supports("avx512bf16") != 0;
  return available;
}

void cpu_attend_bf16(const AttentionInput<float>& in, const AttentionOutput<bfloat16>& out,
                     int threads) {
  using namespace cpu;
  const std::int64_t B = in.batch, N = in.tokens, d = in.dim, H = in.layer.heads;
  const std::int64_t pairs = (d + 1) / 2;
  const std::int64_t columns = (d + 15) / 16 * 16;
  const std::int64_t padded = (N + kTile - 1) / kTile * kTile;
  const std::int64_t stride = padded_columns(d);
  const DenseMaps maps(in);
  const std::vector<QueryRule> rules = self_rules(B, N, in.mask, in.key_lengths);
  const std::int64_t blocks = (N + kBlock - 1) / kBlock;
  // As the float32 engine: a call of under about 4 MFLOP runs on one thread unless told.
  const double work = 4.0 * static_cast<double>(B * H * d) * static_cast<double>(N * N);
  const int team = threads > 0 ? threads : work < 4e6 ? 1 : omp_get_max_threads();
  for (std::int64_t b = 0; b < B; ++b) {
    const float* X = in.cloud + b * N * d;
    std::vector<std::uint32_t> panels(static_cast<std::size_t>(padded * pairs), 0u);
    std::vector<Operands> heads(static_cast<std::size_t>(H));
    for (Operands& op : heads) {
      // Rows up to a whole block, so that a chunk of kRows rows never reads past them.
      op.queries.assign(static_cast<std::size_t>(round_up_block(N) * pairs), 0u);
      op.values.assign(static_cast<std::size_t>(padded / 2 * columns), 0u);
    }
    constexpr std::int64_t kChunk = 256;  // rows per projection task (a multiple of 4 and 2)
    const std::int64_t chunks = (N + kChunk - 1) / kChunk;
#pragma omp parallel num_threads(team)
    {
      std::vector<float> r(static_cast<std::size_t>(kChunk * stride)), c(r.size());
#pragma omp for schedule(dynamic, 1)
      for (std::int64_t task = 0; task < (H + 1) * chunks; ++task) {
        const std::int64_t h = task / chunks, j0 = (task % chunks) * kChunk;
        const std::int64_t count = std::min(kChunk, N - j0);
        if (h == H) {  // the keys, shared by every head
          for (std::int64_t j = j0; j < j0 + count; ++j) {
            const std::int64_t t = j / kTile, jj = j % kTile;
            for (std::int64_t k = 0; k < pairs; ++k) {
              const float hi = 2 * k + 1 < d ? X[j * d + 2 * k + 1] : 0.0f;
              panels[static_cast<std::size_t>((t * pairs + k) * kTile + jj)] =
                  pair_of(X[j * d + 2 * k], hi);
            }
          }
          continue;
        }
        project_rows(X + j0 * d, count, d, maps.layer.query_map + h * d * stride, stride, r.data());
        project_rows(X + j0 * d, count, d, maps.layer.value_map + h * d * stride, stride, c.data());
        Operands& op = heads[static_cast<std::size_t>(h)];
        const float* bias = maps.layer.query_bias ? maps.layer.query_bias + h * stride : nullptr;
        for (std::int64_t i = 0; i < count; ++i) {
          const float* row = r.data() + i * stride;
          for (std::int64_t k = 0; k < pairs; ++k) {
            const float lo = row[2 * k] + (bias ? bias[2 * k] : 0.0f);
            const float hi =
                2 * k + 1 < d ? row[2 * k + 1] + (bias ? bias[2 * k + 1] : 0.0f) : 0.0f;
            op.queries[static_cast<std::size_t>((j0 + i) * pairs + k)] = pair_of(lo, hi);
          }
        }
        for (std::int64_t i = 0; i < count; i += 2) {
          const float* lo = c.data() + i * stride;
          for (std::int64_t a = 0; a < d; ++a) {
            const float hi = i + 1 < count ? lo[stride + a] : 0.0f;
            op.values[static_cast<std::size_t>((j0 + i) / 2 * columns + a)] = pair_of(lo[a], hi);
          }
        }
      }
    }
    const QueryRule& rule = rules[static_cast<std::size_t>(b)];
#pragma omp parallel for num_threads(team) schedule(dynamic, 1)
    for (std::int64_t blk = 0; blk < blocks; ++blk) {
      const std::int64_t i0 = blk * kBlock;
      attend_rows(b, i0, std::min(kBlock, N - i0), in, rule, panels, heads, pairs, columns, out);
    }
  }
}

}  // namespace emflow::detail
