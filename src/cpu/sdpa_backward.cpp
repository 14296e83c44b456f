// The backward pass of the SDPA-shaped operator on the CPU (sdpa.hpp, docs/MATH.md §8.3), fused
// in the FlashAttention-2 way (the algorithm of its flash_bwd_kernel.h, written again on the
// engine's vector layer, simd.hpp).
//
// From the forward pass only lse (and O, and H when the entropy has a gradient) is kept. Per
// query row, before the attention, with D_i = <dO_i, O_i>:
//   E_i = D_i - dlse_i + dH_i H_i,   so that   dS_ij = p_ij (dP_ij - E_i - dH_i (s_ij - lse_i))
// (§8.2's dS regrouped; s_ij - lse_i = log p_ij is the exponent of the weight itself, so the
// entropy's term is formed without the cancellation of s_ij against lse_i - H_i). Then per key
// block of 64 keys (the outer loop: its dK and dV accumulate in a tile of the thread's), per
// query head of its group and per query block of 64 queries that sees it:
//   S = Q~ K^T with Q~ = scale Q (the scores),   P = exp(S - lse),
//   dV += P^T dO,   dP = dO V^T,   dS = P (dP - E - dH (S - lse)),
//   dK += dS^T Q~ (= scale dS^T Q),   dQ' += dS K   (dQ = scale dQ', in float32 buffers).
// Five products of 2 x 64 x 64 x r FLOP per pair of blocks, all by the micro-kernel, 4 rows at a
// time (8 on AVX-512): S and dP against the engine's transposed key and value panels, P^T dO and
// dS^T Q~ reading the tile's columns as the micro-kernel's rows (kTransposedA), dS K against the
// key rows. Nothing N x N is stored: the packed operands take O((Nq + Nk)(r + rv)) floats per
// head, each thread three 64 x 64 tiles and its dK, dV tiles, and dQ' one buffer per span below.
//
// Threads and determinism: the key blocks of each (cloud, key head) are split into spans whose
// number depends on the shape alone (enough to keep the threads busy when the heads are few, at
// most 16). A task is one span, its key blocks in order; so every dK and dV row is summed by one
// thread in one order (the query heads of the group, then the query blocks, ascending). Each
// span writes its dQ' into a buffer of its own, and a last pass sums the spans in order 0, 1, ...
// and scales by `scale`: the gradients are bitwise the same for every thread count (for one build
// on one machine: the vector width sets the order of the sums within a product).
//
// Masks (docs/MATH.md §8.6): a block pair that no visible pair reaches is skipped, one wholly
// visible is not masked, and in the others the hidden scores are set to -inf (weight 0) and their
// dS to exactly 0. The rows of Q~ and dO of queries that see no key are zero, and the packed keys
// and values past the key length too, so a hidden pair only ever meets zeros: no gradient reads
// what a query cannot see, and the upstream gradients of queries without keys are never read.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "core/dispatch.hpp"
#include "engine_internal.hpp"
#include "sdpa.hpp"

namespace emflow::detail::cpu {

using namespace engine;

namespace {

constexpr std::int64_t kBlockKeys = 2 * kKeyTile;  // keys per key block: two panels
constexpr std::int64_t kBlockQueries = 64;         // queries per query block
static_assert(kTokenAlign % kBlockKeys == 0 && kTokenAlign % kBlockQueries == 0, "block sizes");
static_assert(kBlockQueries % kChunkRows == 0 && kBlockKeys % kChunkRows == 0, "chunk rows");
constexpr std::int64_t kTargetTasks = 32;  // spans are made until this many tasks exist
constexpr std::int64_t kMaxSpans = 16;
// Bytes of packed operands and dQ' buffers to hold at once; clouds are processed in groups.
constexpr std::int64_t kGroupBytes = std::int64_t{160} << 20;
constexpr double kSmallCallFlop = 4e6;

/// a * b + c rounded as the micro-kernel's fma (simd.hpp) rounds it: once where the target has
/// FMA. D_i summed so, in the order of dP_ij's sum, equals dP_ij exactly where O_i = v_j (a
/// query with one key), and dS_ij is then exactly 0, as the reference's.
inline float kernel_fma(float a, float b, float c) {
#if defined(__FMA__) || defined(__AVX512F__)
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

/// The shapes every task shares.
struct Shapes {
  std::int64_t Nq = 0, Nk = 0, padded_queries = 0, padded_tokens = 0;
  std::int64_t r = 0, rv = 0, rs = 0, vs = 0;  // widths and padded row lengths
  std::int64_t query_blocks = 0, key_blocks = 0, spans = 1, span_blocks = 1;
  bool has_dO = false, has_dH = false;

  std::int64_t query_floats() const { return padded_queries * rs; }
  std::int64_t upstream_floats() const { return has_dO ? padded_queries * vs : 0; }
  std::int64_t key_floats() const { return padded_tokens * rs; }  // key rows
  std::int64_t panel_floats() const { return padded_tokens * r; }
  std::int64_t value_floats() const { return has_dO ? padded_tokens * rv : 0; }
};

/// The per-row terms of one query head: lse_i, E_i and dH_i (zero for rows without keys).
struct RowTerms {
  float* lse;
  float* e;
  float* dh;
};

/// The packed operands of one query head of one cloud.
struct QueryHead {
  float* queries;   // Q~: padded_queries x rs
  float* upstream;  // dO: padded_queries x vs (null without dO)
  RowTerms terms;
  float* partials;  // dQ': spans x padded_queries x rs
};

/// The packed operands of one key and value head of one cloud.
struct KeyHead {
  float* rows;          // K: padded_tokens x rs
  float* panels;        // K as panels of r x kKeyTile
  float* value_panels;  // V as panels of rv x kKeyTile (null without dO)
};

/// Per-thread working memory.
struct Tiles {
  AlignedBuffer centred;  // S, then S - lse: kBlockQueries x kBlockKeys
  AlignedBuffer weights;  // P
  AlignedBuffer grads;    // dP, then dS
  AlignedBuffer dk, dv;   // kBlockKeys x rs, kBlockKeys x vs
  explicit Tiles(const Shapes& sh)
      : centred(kBlockQueries * kBlockKeys),
        weights(kBlockQueries * kBlockKeys),
        grads(kBlockQueries * kBlockKeys),
        dk(kBlockKeys * sh.rs),
        dv(kBlockKeys * sh.vs) {}
};

enum class Cover { empty, partial, full };

/// The live query rows [q0, q0 + live) against the keys [k0, k0 + kBlockKeys): the visible key
/// intervals only grow with the row (QueryRule::keys), so the rows together see at most
/// [first of the top row, last of the bottom row), and each sees all of
/// [first of the bottom row, last of the top row).
Cover cover(const QueryRule& rule, std::int64_t q0, std::int64_t live, std::int64_t k0) {
  if (live <= 0) return Cover::empty;
  const KeyRange top = rule.keys(q0), bottom = rule.keys(q0 + live - 1);
  const std::int64_t k1 = k0 + kBlockKeys;
  if (bottom.last <= k0 || k1 <= top.first) return Cover::empty;
  return bottom.first <= k0 && k1 <= top.last ? Cover::full : Cover::partial;
}

/// One pair of blocks: the live rows [q0, q0 + live) of query head `q` against the keys
/// [k0, k0 + kBlockKeys) of key head `k` (the algorithm at the top of this file).
void block_pair(const Shapes& sh, const QueryHead& q, const KeyHead& k, const QueryRule& rule,
                std::int64_t q0, std::int64_t live, std::int64_t k0, bool partial,
                float* partial_dq, Tiles& t) {
  constexpr std::int64_t W = kBlockKeys;
  constexpr std::int64_t kVectors = W / kLanes;
  const std::int64_t rows = round_up(live, kChunkRows);
  const std::int64_t tile0 = k0 / kKeyTile;
  float* S = t.centred.data();
  float* P = t.weights.data();
  float* G = t.grads.data();
  const float* Q = q.queries + q0 * sh.rs;
  const float* dO = q.upstream ? q.upstream + q0 * sh.vs : nullptr;

  // S = Q~ K^T, one panel of kKeyTile keys at a time.
  for (std::int64_t i = 0; i < rows; i += kChunkRows) {
    for (std::int64_t p = 0; p < W / kKeyTile; ++p) {
      row_block_gemm<kChunkRows>(sh.r, Q + i * sh.rs, sh.rs,
                                 k.panels + (tile0 + p) * sh.r * kKeyTile, kKeyTile, kKeyTile,
                                 S + i * W + p * kKeyTile, W, false);
    }
  }
  // P = exp(S - lse), the hidden pairs of a partial pair of blocks first set to -inf; the rows
  // past `live` (padding queries) take no part.
  for (std::int64_t i = 0; i < rows; ++i) {
    float* s = S + i * W;
    float* p = P + i * W;
    if (i >= live) {
      std::fill(p, p + W, 0.0f);
      continue;
    }
    if (partial) {
      const KeyRange keys = rule.keys(q0 + i);
      for (std::int64_t j = 0; j < W; ++j) {
        if (!keys.contains(k0 + j)) s[j] = kNegInf;
      }
    }
    const Vec lse = splat(q.terms.lse[q0 + i]);
    for (std::int64_t v = 0; v < kVectors; ++v) {
      const Vec centred = load(s + v * kLanes) - lse;
      store(s + v * kLanes, centred);
      store(p + v * kLanes, exp_nonpositive(centred));
    }
  }
  if (dO != nullptr) {
    // dV += P^T dO (the reduction over the block's query rows), then dP = dO V^T.
    for (std::int64_t j = 0; j < W; j += kChunkRows) {
      row_block_gemm<kChunkRows, true>(rows, P + j, W, dO, sh.vs, sh.vs, t.dv.data() + j * sh.vs,
                                       sh.vs, true);
    }
    for (std::int64_t i = 0; i < rows; i += kChunkRows) {
      for (std::int64_t p = 0; p < W / kKeyTile; ++p) {
        row_block_gemm<kChunkRows>(sh.rv, dO + i * sh.vs, sh.vs,
                                   k.value_panels + (tile0 + p) * sh.rv * kKeyTile, kKeyTile,
                                   kKeyTile, G + i * W + p * kKeyTile, W, false);
      }
    }
  }
  // dS = P (dP - E - dH (S - lse)), exactly 0 on hidden pairs and padding rows.
  for (std::int64_t i = 0; i < rows; ++i) {
    float* g = G + i * W;
    if (i >= live) {
      std::fill(g, g + W, 0.0f);
      continue;
    }
    const Vec e = splat(q.terms.e[q0 + i]);
    const Vec dh = splat(q.terms.dh[q0 + i]);
    const float* s = S + i * W;
    const float* p = P + i * W;
    for (std::int64_t v = 0; v < kVectors; ++v) {
      Vec inner = (dO != nullptr ? load(g + v * kLanes) : Vec{}) - e;
      if (sh.has_dH) inner = fma(dh, Vec{} - load(s + v * kLanes), inner);
      store(g + v * kLanes, load(p + v * kLanes) * inner);
    }
    if (partial) {
      // The hidden pairs: p = 0 there, but the entropy's term reads S - lse = -inf.
      const KeyRange keys = rule.keys(q0 + i);
      for (std::int64_t j = 0; j < W; ++j) {
        if (!keys.contains(k0 + j)) g[j] = 0.0f;
      }
    }
  }
  // dK += dS^T Q~ and dQ' += dS K.
  for (std::int64_t j = 0; j < W; j += kChunkRows) {
    row_block_gemm<kChunkRows, true>(rows, G + j, W, Q, sh.rs, sh.rs, t.dk.data() + j * sh.rs,
                                     sh.rs, true);
  }
  for (std::int64_t i = 0; i < rows; i += kChunkRows) {
    row_block_gemm<kChunkRows>(W, G + i * W, W, k.rows + k0 * sh.rs, sh.rs, sh.rs,
                               partial_dq + (q0 + i) * sh.rs, sh.rs, true);
  }
}

/// The spans of the key blocks: enough tasks for the threads when the (cloud, key head) pairs
/// are few, never depending on the thread count.
void plan_spans(Shapes& sh, std::int64_t pairs) {
  std::int64_t spans = (kTargetTasks + pairs - 1) / pairs;
  spans = std::clamp<std::int64_t>(spans, 1, std::min(kMaxSpans, sh.key_blocks));
  sh.span_blocks = (sh.key_blocks + spans - 1) / spans;
  sh.spans = (sh.key_blocks + sh.span_blocks - 1) / sh.span_blocks;
}

}  // namespace

bool sdpa_backward_finite(const SdpaArrays& a, const SdpaBackwardArrays& saved) {
  const std::int64_t Nq = a.query_tokens, rv = a.value_rank;
  for (std::int64_t b = 0; b < a.batch; ++b) {
    const QueryRule& rule = a.rules[b];
    for (std::int64_t h = 0; h < a.query_heads; ++h) {
      const std::int64_t head = (b * a.query_heads + h) * Nq;
      for (std::int64_t i = 0; i < rule.query_length; ++i) {
        if (rule.keys(i).empty()) continue;
        const std::int64_t row = head + i;
        const bool finite =
            all_finite(saved.lse + row, 1) &&
            (!saved.output_gradient || (all_finite(saved.output_gradient + row * rv, rv) &&
                                        all_finite(saved.output + row * rv, rv))) &&
            (!saved.lse_gradient || all_finite(saved.lse_gradient + row, 1)) &&
            (!saved.entropy_gradient ||
             (all_finite(saved.entropy_gradient + row, 1) && all_finite(saved.entropy + row, 1)));
        if (!finite) return false;
      }
    }
  }
  return true;
}

void sdpa_backward(const SdpaArrays& a, const SdpaBackwardArrays& saved,
                   const SdpaGradientArrays& out, int threads) {
  const std::int64_t B = a.batch, Hq = a.query_heads, Hkv = a.kv_heads, group_heads = a.group();
  Shapes sh;
  sh.Nq = a.query_tokens;
  sh.Nk = a.tokens;
  sh.padded_queries = round_up(sh.Nq, kTokenAlign);
  sh.padded_tokens = round_up(sh.Nk, kTokenAlign);
  sh.r = a.rank;
  sh.rv = a.value_rank;
  sh.rs = padded_columns(sh.r);
  sh.vs = padded_columns(sh.rv);
  sh.query_blocks = sh.padded_queries / kBlockQueries;
  sh.key_blocks = sh.padded_tokens / kBlockKeys;
  sh.has_dO = saved.output_gradient != nullptr;
  sh.has_dH = saved.entropy_gradient != nullptr;
  plan_spans(sh, B * Hkv);
  const std::int64_t Nq = sh.Nq, Nk = sh.Nk, r = sh.r, rv = sh.rv;

  const double work = 5.0 * static_cast<double>(B * Hq) * static_cast<double>(Nq) *
                      static_cast<double>(Nk) * static_cast<double>(r + rv);
  const int team = threads > 0 ? threads : work < kSmallCallFlop ? 1 : omp_get_max_threads();

  // Per cloud of the batch: Hq query heads (Q~, dO, the row terms, a dQ' per span) and Hkv key
  // heads (K rows, K panels, V panels).
  const std::int64_t head_floats = sh.query_floats() + sh.upstream_floats() +
                                   3 * sh.padded_queries + sh.spans * sh.query_floats();
  const std::int64_t key_floats = sh.key_floats() + sh.panel_floats() + sh.value_floats();
  const std::int64_t cloud_floats = Hq * head_floats + Hkv * key_floats;
  const std::int64_t group = std::clamp<std::int64_t>(kGroupBytes / (4 * cloud_floats), 1, B);
  AlignedBuffer heads(group * Hq * head_floats);
  AlignedBuffer keys(group * Hkv * key_floats);
  std::vector<QueryHead> query_heads(static_cast<std::size_t>(group * Hq));
  std::vector<KeyHead> key_heads(static_cast<std::size_t>(group * Hkv));
  for (std::int64_t e = 0; e < group * Hq; ++e) {
    float* base = heads.data() + e * head_floats;
    QueryHead& q = query_heads[static_cast<std::size_t>(e)];
    q.queries = base;
    base += sh.query_floats();
    q.upstream = sh.has_dO ? base : nullptr;
    base += sh.upstream_floats();
    q.terms = {base, base + sh.padded_queries, base + 2 * sh.padded_queries};
    q.partials = base + 3 * sh.padded_queries;
  }
  for (std::int64_t e = 0; e < group * Hkv; ++e) {
    float* base = keys.data() + e * key_floats;
    KeyHead& k = key_heads[static_cast<std::size_t>(e)];
    k.rows = base;
    k.panels = base + sh.key_floats();
    k.value_panels = sh.has_dO ? base + sh.key_floats() + sh.panel_floats() : nullptr;
  }
  std::vector<std::unique_ptr<Tiles>> tiles;
  for (int t = 0; t < team; ++t) tiles.push_back(std::make_unique<Tiles>(sh));
  // dL/dscale per (cloud, query head, query block), summed in that order at the end.
  std::vector<double> scale_terms(static_cast<std::size_t>(B * Hq * sh.query_blocks), 0.0);

  for (std::int64_t first = 0; first < B; first += group) {
    const std::int64_t count = std::min(group, B - first);
#pragma omp parallel num_threads(team)
    {
      Tiles& t = *tiles[static_cast<std::size_t>(omp_get_thread_num())];
      // Phase 1, one 64-row block of a query head or of a key head per task: Q~, dO and the row
      // terms (zero on the rows of queries without keys, which are not read), the real keys as
      // rows and panels and the real values as panels (zero past the key length), the dQ'
      // buffers zeroed.
      const std::int64_t query_tasks = count * Hq * sh.query_blocks;
      const std::int64_t key_tasks = count * Hkv * sh.key_blocks;
#pragma omp for schedule(dynamic, 1)
      for (std::int64_t task = 0; task < query_tasks + key_tasks; ++task) {
        if (task < query_tasks) {
          const std::int64_t e = task / sh.query_blocks;  // c * Hq + h
          const std::int64_t b = first + e / Hq;
          const std::int64_t row0 = (task % sh.query_blocks) * kBlockQueries;
          const std::int64_t row_end = std::min(row0 + kBlockQueries, Nq);
          const QueryRule& rule = a.rules[b];
          const QueryHead& q = query_heads[static_cast<std::size_t>(e)];
          const std::int64_t head = (first * Hq + e) * Nq;  // the head's first row
          pack_query_rows(a.queries + head * r, r, a.scale, rule, row0, row_end, q.queries, sh.rs);
          if (q.upstream) {
            pack_query_rows(saved.output_gradient + head * rv, rv, 1.0f, rule, row0, row_end,
                            q.upstream, sh.vs);
          }
          for (std::int64_t i = row0; i < row_end; ++i) {
            const std::int64_t row = head + i;
            double lse = 0.0, e_term = 0.0, dh = 0.0;
            if (!rule.keys(i).empty()) {
              lse = saved.lse[row];
              if (saved.output_gradient) {
                const float* dO = saved.output_gradient + row * rv;
                const float* o = saved.output + row * rv;
                float D = 0.0f;
                for (std::int64_t c = 0; c < rv; ++c) D = kernel_fma(dO[c], o[c], D);
                e_term = D;
              }
              if (saved.lse_gradient) e_term -= saved.lse_gradient[row];
              if (saved.entropy_gradient) {
                dh = saved.entropy_gradient[row];
                e_term += dh * static_cast<double>(saved.entropy[row]);
              }
            }
            q.terms.lse[i] = static_cast<float>(lse);
            q.terms.e[i] = static_cast<float>(e_term);
            q.terms.dh[i] = static_cast<float>(dh);
          }
          for (std::int64_t s = 0; s < sh.spans; ++s) {
            float* dq = q.partials + s * sh.query_floats();
            std::fill(dq + row0 * sh.rs, dq + (row0 + kBlockQueries) * sh.rs, 0.0f);
          }
          continue;
        }
        const std::int64_t key_task = task - query_tasks;
        const std::int64_t e = key_task / sh.key_blocks;  // c * Hkv + g
        const std::int64_t row0 = (key_task % sh.key_blocks) * kBlockKeys;
        const std::int64_t row_end = std::min(row0 + kBlockKeys, Nk);
        const std::int64_t set = first * Hkv + e;
        const std::int64_t length = a.rules[first + e / Hkv].key_length;
        const KeyHead& k = key_heads[static_cast<std::size_t>(e)];
        pack_real_rows(a.keys + set * Nk * r, r, length, row0, row_end, k.rows, sh.rs);
        pack_real_panels(a.keys + set * Nk * r, r, length, row0, row_end, k.panels);
        if (k.value_panels) {
          pack_real_panels(a.values + set * Nk * rv, rv, length, row0, row_end, k.value_panels);
        }
      }

      // Phase 2, one span of key blocks of one key head per task, the first spans (under a
      // causal mask those with the most queries) first.
      const std::int64_t span_tasks = sh.spans * count * Hkv;
#pragma omp for schedule(dynamic, 1)
      for (std::int64_t task = 0; task < span_tasks; ++task) {
        const std::int64_t span = task / (count * Hkv);
        const std::int64_t e = task % (count * Hkv);  // c * Hkv + g
        const std::int64_t c = e / Hkv, g = e % Hkv, b = first + c;
        const QueryRule& rule = a.rules[b];
        const KeyHead& k = key_heads[static_cast<std::size_t>(e)];
        const std::int64_t block_end = std::min(sh.key_blocks, (span + 1) * sh.span_blocks);
        for (std::int64_t block = span * sh.span_blocks; block < block_end; ++block) {
          const std::int64_t k0 = block * kBlockKeys;
          std::fill(t.dk.data(), t.dk.data() + kBlockKeys * sh.rs, 0.0f);
          std::fill(t.dv.data(), t.dv.data() + kBlockKeys * sh.vs, 0.0f);
          for (std::int64_t hh = 0; hh < group_heads; ++hh) {
            const std::int64_t h = g * group_heads + hh;
            const QueryHead& q = query_heads[static_cast<std::size_t>(c * Hq + h)];
            float* partial_dq = q.partials + span * sh.query_floats();
            for (std::int64_t qb = 0; qb < sh.query_blocks; ++qb) {
              const std::int64_t q0 = qb * kBlockQueries;
              const std::int64_t live =
                  std::clamp<std::int64_t>(rule.query_length - q0, 0, kBlockQueries);
              const Cover pair = cover(rule, q0, live, k0);
              if (pair == Cover::empty) continue;
              block_pair(sh, q, k, rule, q0, live, k0, pair == Cover::partial, partial_dq, t);
            }
          }
          // This block's dK and dV rows, each written once (zero for keys no query sees).
          const std::int64_t set = b * Hkv + g;
          for (std::int64_t j = k0; j < std::min(k0 + kBlockKeys, Nk); ++j) {
            const float* dk = t.dk.data() + (j - k0) * sh.rs;
            std::copy(dk, dk + r, out.keys + (set * Nk + j) * r);
            float* dv = out.values + (set * Nk + j) * rv;
            if (sh.has_dO) {
              const float* src = t.dv.data() + (j - k0) * sh.vs;
              std::copy(src, src + rv, dv);
            } else {
              std::fill(dv, dv + rv, 0.0f);
            }
          }
        }
      }

      // Phase 3, one query block of one query head per task: dQ = scale (sum of the spans'
      // dQ' in span order), and dL/dscale = sum_i <dQ'_i, q_i> over the queries with keys.
#pragma omp for schedule(dynamic, 1)
      for (std::int64_t task = 0; task < query_tasks; ++task) {
        const std::int64_t e = task / sh.query_blocks;  // c * Hq + h
        const std::int64_t b = first + e / Hq;
        const std::int64_t qb = task % sh.query_blocks;
        const std::int64_t row0 = qb * kBlockQueries;
        const QueryRule& rule = a.rules[b];
        const QueryHead& q = query_heads[static_cast<std::size_t>(e)];
        const std::int64_t head = (first * Hq + e) * Nq;
        double scale_term = 0.0;
        for (std::int64_t i = row0; i < std::min(row0 + kBlockQueries, Nq); ++i) {
          float* dst = out.queries + (head + i) * r;
          const float* src = q.partials + i * sh.rs;
          std::copy(src, src + r, dst);
          for (std::int64_t s = 1; s < sh.spans; ++s) {
            const float* more = src + s * sh.query_floats();
            for (std::int64_t c = 0; c < r; ++c) dst[c] += more[c];
          }
          if (out.scale != nullptr && !rule.keys(i).empty()) {
            const float* qi = a.queries + (head + i) * r;
            for (std::int64_t c = 0; c < r; ++c) {
              scale_term += static_cast<double>(dst[c]) * static_cast<double>(qi[c]);
            }
          }
          for (std::int64_t c = 0; c < r; ++c) dst[c] *= a.scale;
        }
        scale_terms[static_cast<std::size_t>((first * Hq + e) * sh.query_blocks + qb)] = scale_term;
      }
    }
  }
  if (out.scale != nullptr) {
    double total = 0.0;
    for (double term : scale_terms) total += term;
    *out.scale = total;
  }
}

}  // namespace emflow::detail::cpu
