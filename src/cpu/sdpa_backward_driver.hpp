// The FlashAttention-2 backward pass of the SDPA-shaped operator (docs/MATH.md §8.3), written
// once for the CPU's product kernels: sdpa_backward.cpp (float32 products, simd.hpp) and
// sdpa_backward_bf16.cpp (AVX512-BF16 products). A kernel packs its operands in its own layouts
// and computes one pair of blocks; this driver owns the rest: the per-row terms, the spans of key
// blocks, the threads, the order of every sum, and the outputs.
//
// From the forward pass only lse (and O, and H when the entropy has a gradient) is kept. Per
// query row, before the attention, with D_i = <dO_i, O_i>:
//   E_i = D_i - dlse_i + dH_i H_i,   so that   dS_ij = p_ij (dP_ij - E_i - dH_i (s_ij - lse_i))
// (§8.2's dS regrouped; s_ij - lse_i = log p_ij is the exponent of the weight itself, so the
// entropy's term is formed without the cancellation of s_ij against lse_i - H_i). Then per key
// block of 64 keys (the outer loop: its dK and dV accumulate in a tile of the thread's), per
// query head of its group and per query block of 64 queries that sees it, the kernel computes
//   S = scale Q K^T,   P = exp(S - lse),   dV += P^T dO,   dP = dO V^T,
//   dS = P (dP - E - dH (S - lse)),   dK += dS^T Q (times scale),   dQ' += dS K
// (dQ = scale dQ', in float32 buffers). Nothing N x N is stored: the packed operands take
// O((Nq + Nk)(r + rv)) per head, each thread its tiles of 64 x 64 and its dK and dV tiles, and dQ'
// one buffer per span below.
//
// Threads and determinism: the key blocks of each (cloud, key head) are dealt into spans (block b
// to span b mod S, so that under a causal mask every span gets early and late keys alike) whose
// number S depends on the shape alone: enough to keep the threads busy when the heads are few, at
// most 16, and fewer where the spans' dQ' buffers would outgrow a last-level cache. A task is one
// span, its key blocks in order; so every dK and dV row is summed by one thread in one order (the
// query heads of the group, then the query blocks, ascending). Each span writes its dQ' into a
// buffer of its own, and a last pass sums the spans in order 0, 1, ... and scales by `scale`: the
// gradients are bitwise the same for every thread count (for one build on one machine: the
// vector width sets the order of the sums within a product).
//
// Masks (docs/MATH.md §8.6): a block pair that no visible pair reaches is skipped, one wholly
// visible is not masked, and in the others the kernel sets the hidden scores to -inf (weight 0)
// and their dS to exactly 0. The packed queries and upstream gradients of queries that see no key
// are zero, and the packed keys and values past the key length too, so a hidden pair only ever
// meets zeros: no gradient reads what a query cannot see, and the upstream gradients of queries
// without keys are never read.
//
// The kernel interface (a class K, constructed from the Shapes, shared by every thread):
//   K::kQueryAlign                rows a query block's packing may pair (1 or 2)
//   query_floats(), key_floats()  packed floats per query head and per key head
//   dq_stride, dk_stride, dv_stride   row lengths of dQ' and of the dK and dV tiles
//   dk_factor                     what the dK tile is multiplied by when written
//   pack_query(a, saved, rule, head_row, row0, row_end, packed)
//       the rows [row0, row_end) of the query head whose first row is `head_row` (of Q, dO)
//   pack_keys(a, set, length, row0, row_end, packed)   the rows of key and value head `set`
//   K::Tiles(K)                   a thread's working memory for block_pair
//   block_pair(query, terms, key, rule, q0, live, k0, partial, partial_dq, dk, dv, tiles)
//                                 adds the pair's dK and dV to the thread's key block tiles
//                                 (kBlockKeys rows of dk_stride and dv_stride floats)
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "engine_internal.hpp"
#include "sdpa.hpp"
#include "target.hpp"

EMFLOW_CPU_BEGIN
namespace backward {

using engine::AlignedBuffer;
using engine::kTokenAlign;
using engine::round_up;

inline constexpr std::int64_t kBlockKeys = 64;     // keys per key block
inline constexpr std::int64_t kBlockQueries = 64;  // queries per query block
static_assert(kTokenAlign % kBlockKeys == 0 && kTokenAlign % kBlockQueries == 0, "block sizes");
inline constexpr std::int64_t kTargetTasks = 32;  // spans are made until this many tasks exist
inline constexpr std::int64_t kMaxSpans = 16;
// The dQ' buffers of a call are kept under this size (each is read and written by every key
// block of its span, and summed at the end) unless fewer than 2 spans would do it.
inline constexpr std::int64_t kPartialBytes = std::int64_t{8} << 20;
// Bytes of packed operands and dQ' buffers to hold at once; clouds are processed in groups.
inline constexpr std::int64_t kGroupBytes = std::int64_t{160} << 20;
inline constexpr double kSmallCallFlop = 4e6;

/// a * b + c rounded as the micro-kernel's fma (simd.hpp) rounds it: once on the x86-64 paths.
/// D_i summed so, in the order of dP_ij's sum, equals dP_ij exactly where O_i = v_j (a query
/// with one key), and dS_ij is then exactly 0, as the reference's.
inline float kernel_fma(float a, float b, float c) {
#if EMFLOW_CPU_AVX2
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

/// The shapes every task shares.
struct Shapes {
  std::int64_t Nq = 0, Nk = 0, padded_queries = 0, padded_tokens = 0;
  std::int64_t r = 0, rv = 0;
  std::int64_t query_blocks = 0, key_blocks = 0, spans = 1;
  bool has_dO = false, has_dH = false;
};

/// The per-row terms of one query head: lse_i, E_i and dH_i (zero for rows without keys).
struct RowTerms {
  float* lse;
  float* e;
  float* dh;
};

enum class Cover { empty, partial, full };

/// The live query rows [q0, q0 + live) against the keys [k0, k0 + kBlockKeys): the visible key
/// intervals only grow with the row (QueryRule::keys), so the rows together see at most
/// [first of the top row, last of the bottom row), and each sees all of
/// [first of the bottom row, last of the top row).
inline Cover cover(const QueryRule& rule, std::int64_t q0, std::int64_t live, std::int64_t k0) {
  if (live <= 0) return Cover::empty;
  const KeyRange top = rule.keys(q0), bottom = rule.keys(q0 + live - 1);
  const std::int64_t k1 = k0 + kBlockKeys;
  if (bottom.last <= k0 || k1 <= top.first) return Cover::empty;
  return bottom.first <= k0 && k1 <= top.last ? Cover::full : Cover::partial;
}

/// The number of spans: enough tasks for the threads when the (cloud, key head) pairs are few,
/// fewer where `span_bytes` (the dQ' buffers of one span over the call) would make them outgrow
/// kPartialBytes; never depending on the thread count.
inline void plan_spans(Shapes& sh, std::int64_t pairs, std::int64_t span_bytes) {
  std::int64_t spans = (kTargetTasks + pairs - 1) / pairs;
  spans = std::clamp<std::int64_t>(spans, 1, std::min(kMaxSpans, sh.key_blocks));
  const std::int64_t fit =
      std::max<std::int64_t>(2, kPartialBytes / std::max<std::int64_t>(span_bytes, 1));
  sh.spans = std::min(spans, fit);
}

/// Sets the entries of `row` (the keys [k0, k0 + kBlockKeys) of query `query`) that `rule`
/// hides to `value`: -inf on the scores of a partial pair of blocks, 0 on their dS.
inline void set_hidden(const QueryRule& rule, std::int64_t query, std::int64_t k0, float* row,
                       float value) {
  const KeyRange keys = rule.keys(query);
  for (std::int64_t j = 0; j < kBlockKeys; ++j) {
    if (!keys.contains(k0 + j)) row[j] = value;
  }
}

/// The row terms of the rows [row0, row_end) of the query head whose first row is `head_row`.
inline void row_terms(const SdpaArrays& a, const SdpaBackwardArrays& saved, const QueryRule& rule,
                      std::int64_t head_row, std::int64_t row0, std::int64_t row_end,
                      const RowTerms& terms) {
  const std::int64_t rv = a.value_rank;
  for (std::int64_t i = row0; i < row_end; ++i) {
    const std::int64_t row = head_row + i;
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
    terms.lse[i] = static_cast<float>(lse);
    terms.e[i] = static_cast<float>(e_term);
    terms.dh[i] = static_cast<float>(dh);
  }
}

/// The backward pass of `a` with kernel K (the algorithm at the top of this file).
template <class K>
void run(const SdpaArrays& a, const SdpaBackwardArrays& saved, const SdpaGradientArrays& out,
         int threads) {
  const std::int64_t B = a.batch, Hq = a.query_heads, Hkv = a.kv_heads, group_heads = a.group();
  Shapes sh;
  sh.Nq = a.query_tokens;
  sh.Nk = a.tokens;
  sh.padded_queries = round_up(sh.Nq, kTokenAlign);
  sh.padded_tokens = round_up(sh.Nk, kTokenAlign);
  sh.r = a.rank;
  sh.rv = a.value_rank;
  sh.query_blocks = sh.padded_queries / kBlockQueries;
  sh.key_blocks = sh.padded_tokens / kBlockKeys;
  sh.has_dO = saved.output_gradient != nullptr;
  sh.has_dH = saved.entropy_gradient != nullptr;
  const K kernel(sh, a.scale);
  plan_spans(sh, B * Hkv, B * Hq * sh.padded_queries * kernel.dq_stride * 4);
  const std::int64_t Nq = sh.Nq, Nk = sh.Nk, r = sh.r, rv = sh.rv;

  const double work = 5.0 * static_cast<double>(B * Hq) * static_cast<double>(Nq) *
                      static_cast<double>(Nk) * static_cast<double>(r + rv);
  const int team = threads > 0 ? threads : work < kSmallCallFlop ? 1 : omp_get_max_threads();

  // Per cloud of the batch: Hq query heads (the kernel's packed operands, the row terms, a dQ'
  // per span) and Hkv key heads (the kernel's packed keys and values).
  const std::int64_t partial_floats = sh.padded_queries * kernel.dq_stride;
  const std::int64_t head_floats = kernel.query_floats() + 3 * sh.padded_queries;
  const std::int64_t key_floats = kernel.key_floats();
  const std::int64_t cloud_floats =
      Hq * (head_floats + sh.spans * partial_floats) + Hkv * key_floats;
  const std::int64_t group = std::clamp<std::int64_t>(kGroupBytes / (4 * cloud_floats), 1, B);
  // The packed operands are zero where no packing writes (rows past the tokens); the dQ'
  // buffers are zeroed block by block in phase 1, by the threads that use them.
  AlignedBuffer heads(group * Hq * head_floats);
  AlignedBuffer partials(group * Hq * sh.spans * partial_floats, /*zeroed=*/false);
  AlignedBuffer keys(group * Hkv * key_floats);
  const auto packed_query = [&](std::int64_t e) { return heads.data() + e * head_floats; };
  const auto terms_of = [&](std::int64_t e) {
    float* base = packed_query(e) + kernel.query_floats();
    return RowTerms{base, base + sh.padded_queries, base + 2 * sh.padded_queries};
  };
  const auto partials_of = [&](std::int64_t e) {
    return partials.data() + e * sh.spans * partial_floats;
  };
  const auto packed_key = [&](std::int64_t e) { return keys.data() + e * key_floats; };
  std::vector<std::unique_ptr<typename K::Tiles>> tiles;
  for (int t = 0; t < team; ++t) tiles.push_back(std::make_unique<typename K::Tiles>(kernel));
  // Each thread's dK and dV of its current key block.
  AlignedBuffer key_grads(team * kBlockKeys * kernel.dk_stride);
  AlignedBuffer value_grads(team * kBlockKeys * kernel.dv_stride);
  // dL/dscale per (cloud, query head, query block), summed in that order at the end.
  std::vector<double> scale_terms(static_cast<std::size_t>(B * Hq * sh.query_blocks), 0.0);

  for (std::int64_t first = 0; first < B; first += group) {
    const std::int64_t count = std::min(group, B - first);
#pragma omp parallel num_threads(team)
    {
      const int thread = omp_get_thread_num();
      typename K::Tiles& t = *tiles[static_cast<std::size_t>(thread)];
      float* const dk_tile = key_grads.data() + thread * kBlockKeys * kernel.dk_stride;
      float* const dv_tile = value_grads.data() + thread * kBlockKeys * kernel.dv_stride;
      // Phase 1, one 64-row block of a query head or of a key head per task: the kernel's
      // packing (zero on the rows of queries without keys and past the key length), the row
      // terms, the dQ' buffers zeroed.
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
          const std::int64_t head_row = (first * Hq + e) * Nq;
          kernel.pack_query(a, saved, rule, head_row, row0, row_end, packed_query(e));
          row_terms(a, saved, rule, head_row, row0, row_end, terms_of(e));
          for (std::int64_t s = 0; s < sh.spans; ++s) {
            float* dq = partials_of(e) + s * partial_floats;
            std::fill(dq + row0 * kernel.dq_stride, dq + (row0 + kBlockQueries) * kernel.dq_stride,
                      0.0f);
          }
          continue;
        }
        const std::int64_t key_task = task - query_tasks;
        const std::int64_t e = key_task / sh.key_blocks;  // c * Hkv + g
        const std::int64_t row0 = (key_task % sh.key_blocks) * kBlockKeys;
        const std::int64_t row_end = std::min(row0 + kBlockKeys, Nk);
        kernel.pack_keys(a, first * Hkv + e, a.rules[first + e / Hkv].key_length, row0, row_end,
                         packed_key(e));
      }

      // Phase 2, one span of key blocks of one key head per task.
      const std::int64_t span_tasks = sh.spans * count * Hkv;
#pragma omp for schedule(dynamic, 1)
      for (std::int64_t task = 0; task < span_tasks; ++task) {
        const std::int64_t span = task / (count * Hkv);
        const std::int64_t e = task % (count * Hkv);  // c * Hkv + g
        const std::int64_t c = e / Hkv, g = e % Hkv, b = first + c;
        const QueryRule& rule = a.rules[b];
        for (std::int64_t block = span; block < sh.key_blocks; block += sh.spans) {
          const std::int64_t k0 = block * kBlockKeys;
          std::fill(dk_tile, dk_tile + kBlockKeys * kernel.dk_stride, 0.0f);
          std::fill(dv_tile, dv_tile + kBlockKeys * kernel.dv_stride, 0.0f);
          for (std::int64_t hh = 0; hh < group_heads; ++hh) {
            const std::int64_t q_head = c * Hq + g * group_heads + hh;
            float* partial_dq = partials_of(q_head) + span * partial_floats;
            for (std::int64_t qb = 0; qb < sh.query_blocks; ++qb) {
              const std::int64_t q0 = qb * kBlockQueries;
              const std::int64_t live =
                  std::clamp<std::int64_t>(rule.query_length - q0, 0, kBlockQueries);
              const Cover pair = cover(rule, q0, live, k0);
              if (pair == Cover::empty) continue;
              kernel.block_pair(packed_query(q_head), terms_of(q_head), packed_key(e), rule, q0,
                                live, k0, pair == Cover::partial, partial_dq, dk_tile, dv_tile, t);
            }
          }
          // This block's dK and dV rows, each written once (zero for keys no query sees).
          const std::int64_t set = b * Hkv + g;
          for (std::int64_t j = k0; j < std::min(k0 + kBlockKeys, Nk); ++j) {
            const float* dk = dk_tile + (j - k0) * kernel.dk_stride;
            float* dst = out.keys + (set * Nk + j) * r;
            for (std::int64_t col = 0; col < r; ++col) dst[col] = kernel.dk_factor * dk[col];
            float* dv = out.values + (set * Nk + j) * rv;
            if (sh.has_dO) {
              const float* src = dv_tile + (j - k0) * kernel.dv_stride;
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
        const std::int64_t head_row = (first * Hq + e) * Nq;
        double scale_term = 0.0;
        for (std::int64_t i = row0; i < std::min(row0 + kBlockQueries, Nq); ++i) {
          float* dst = out.queries + (head_row + i) * r;
          const float* src = partials_of(e) + i * kernel.dq_stride;
          std::copy(src, src + r, dst);
          for (std::int64_t s = 1; s < sh.spans; ++s) {
            const float* more = src + s * partial_floats;
            for (std::int64_t col = 0; col < r; ++col) dst[col] += more[col];
          }
          if (out.scale != nullptr && !rule.keys(i).empty()) {
            const float* qi = a.queries + (head_row + i) * r;
            for (std::int64_t col = 0; col < r; ++col) {
              scale_term += static_cast<double>(dst[col]) * static_cast<double>(qi[col]);
            }
          }
          for (std::int64_t col = 0; col < r; ++col) dst[col] *= a.scale;
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

}  // namespace backward
EMFLOW_CPU_END
