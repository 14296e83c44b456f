// Phase 2 of the fused CPU engine (see engine.cpp): one block of queries of one cloud meets the
// key tiles of every head, with an online softmax, and its update is written in head order.
#include <algorithm>
#include <cmath>
#include <vector>

#include "engine_internal.hpp"
#include "target.hpp"

EMFLOW_CPU_BEGIN
namespace engine {

namespace {

/// Which keys of a tile a set of query rows may see.
enum class TileCover { empty, partial, full };

/// The keys query i sees within the span (an empty range when none).
KeyRange keys_in(const QueryRule& rule, std::int64_t i, KeySpan span) {
  KeyRange keys = rule.keys(i);
  keys.first = std::max(keys.first, span.first);
  keys.last = std::max(keys.first, std::min(keys.last, span.last));
  return keys;
}

/// Rows [row_begin, row_end) against keys [key_begin, key_begin + kKeyTile). Visible key
/// intervals only grow with the row (QueryRule::keys, clipped to the span), so the rows together
/// see [first of the top row, last of the bottom row) and each of them sees
/// [first of the bottom row, last of the top row).
TileCover cover(const QueryRule& rule, KeySpan span, std::int64_t row_begin, std::int64_t row_end,
                std::int64_t key_begin) {
  if (row_end <= row_begin) return TileCover::empty;
  const std::int64_t key_end = key_begin + kKeyTile;
  const KeyRange top = keys_in(rule, row_begin, span);
  const KeyRange bottom = keys_in(rule, row_end - 1, span);
  if (key_begin >= bottom.last || key_end <= top.first) return TileCover::empty;
  return bottom.first <= key_begin && key_end <= top.last ? TileCover::full : TileCover::partial;
}

/// Online-softmax step for the rows [row0, row0 + rows) of a block on one key tile: masks the
/// scores if the tile is partial, updates m, Z, E and rescales O rows where m grows, and turns
/// the scores into unnormalised weights exp(s - m) in place.
void softmax_step(float* scores, int rows, std::int64_t local_row0, std::int64_t query0,
                  std::int64_t key0, bool partial, const QueryRule& rule, KeySpan span,
                  const Geometry& g, Scratch& s) {
  constexpr std::int64_t kVectors = kKeyTile / kLanes;
  for (int r = 0; r < rows; ++r) {
    const std::int64_t local = local_row0 + r;
    float* row = scores + r * kKeyTile;
    if (partial) {
      const KeyRange keys = keys_in(rule, query0 + r, span);
      for (std::int64_t jj = 0; jj < kKeyTile; ++jj) {
        if (!keys.contains(key0 + jj)) row[jj] = kNegInf;
      }
    }
    Vec tile_max = load(row);
    for (std::int64_t v = 1; v < kVectors; ++v) tile_max = max(tile_max, load(row + v * kLanes));
    const float old_max = s.running_max[static_cast<std::size_t>(local)];
    float* z = s.sums.data() + local * kLanes;
    float* e = s.entropy_sums.data() + local * kLanes;
    // Most tiles do not raise the running max: one vector compare instead of a reduction.
    float new_max = old_max;
    if (any_greater(tile_max, splat(old_max))) {
      new_max = horizontal_max(tile_max);
      float* o = s.head_output.data() + local * g.value_stride;
      if (old_max == kNegInf) {  // first visible key: O, Z and E are still zero
        std::fill(o, o + g.value_stride, 0.0f);
      } else {
        // exp(s - m_new) = alpha exp(s - m_old): rescale O and Z; E also gains (m_old - m_new) Z.
        const Vec alpha = splat(std::exp(old_max - new_max));
        const Vec shift = splat(old_max - new_max);
        const Vec zv = load(z);
        store(e, alpha * fma(shift, zv, load(e)));
        store(z, alpha * zv);
        for (std::int64_t a = 0; a < g.value_stride; a += kLanes) {
          store(o + a, alpha * load(o + a));
        }
      }
      s.running_max[static_cast<std::size_t>(local)] = new_max;
    } else if (old_max == kNegInf) {
      // Nothing finite for this row yet: its scores here are -inf or NaN (which the max above
      // drops). Rare (a window row past a partial tile, or NaN scores), so a sum tells them
      // apart: a NaN makes the running max NaN, which every later step carries (§6.6).
      Vec sum = load(row);
      for (std::int64_t v = 1; v < kVectors; ++v) sum += load(row + v * kLanes);
      const float total = horizontal_sum(sum);
      std::fill(row, row + kKeyTile, total == total ? 0.0f : total);
      if (total != total) s.running_max[static_cast<std::size_t>(local)] = total;
      continue;
    }
    const Vec m = splat(new_max);
    const Vec floor_value = splat(-1.0e4f);  // keeps 0 * (s - m) finite where s = -inf
    Vec zv = load(z), ev = load(e);
    for (std::int64_t v = 0; v < kVectors; ++v) {
      const Vec centred = load(row + v * kLanes) - m;
      const Vec p = exp_nonpositive(centred);
      zv += p;
      ev = fma(p, max(centred, floor_value), ev);
      store(row + v * kLanes, p);
    }
    store(z, zv);
    store(e, ev);
  }
}

/// One chunk of R query rows (R of 1, 2, 4 or kChunkRows) against one key tile: the scores,
/// the softmax step, and O += P V. A chunk of fewer live rows than kChunkRows (a decode step's
/// one query, a few queries of their own) takes the smallest R that holds them, so it computes
/// its own rows and not a whole chunk's.
template <int R>
void chunk_tile(const HeadOperands& op, const float* panel, const float* values,
                std::int64_t local_row0, std::int64_t query0, std::int64_t key0, bool partial,
                const QueryRule& rule, KeySpan span, const Geometry& g, Scratch& s) {
  float* scores = s.scores.data();
  row_block_gemm<R>(g.score_dim, op.queries + query0 * g.score_stride, g.score_stride, panel,
                    kKeyTile, kKeyTile, scores, kKeyTile, false);
  softmax_step(scores, R, local_row0, query0, key0, partial, rule, span, g, s);
  // A row whose running max is still -inf has weights 0: it adds nothing that counts (its O is
  // set when the block is finished).
  row_block_gemm<R>(kKeyTile, scores, kKeyTile, values, g.value_stride, g.value_stride,
                    s.head_output.data() + local_row0 * g.value_stride, g.value_stride, true);
}

}  // namespace

void attend_block(std::int64_t b, std::int64_t query_begin, const Geometry& g,
                  const std::vector<HeadOperands>& heads, const EngineLayer& layer,
                  const QueryRule& rule, KeySpan span, const EngineOutput& sink, Scratch& s) {
  const AttentionOutput<float>& out = sink.attend;
  const bool partial = sink.partial.heads != nullptr;
  const std::int64_t N = g.tokens, Nq = g.query_tokens;
  const std::int64_t rows = std::min(g.query_block, Nq - query_begin);
  // Rows past the query length are padding and see no key; the others see the keys of their
  // rule (for self-attention always key i).
  const std::int64_t live = std::clamp<std::int64_t>(rule.query_length - query_begin, 0, rows);
  const std::int64_t live_chunks = round_up(live, kChunkRows);
  float* update = s.update.data();
  if (!partial) std::fill(update, update + live_chunks * g.dim_stride, 0.0f);
  std::fill(s.saw_key.begin(), s.saw_key.end(), 0);

  // Key tiles any live row of the block can see.
  std::int64_t key_begin = 0;
  std::int64_t key_end = 0;
  if (live > 0) {
    key_begin = keys_in(rule, query_begin, span).first;
    key_end = keys_in(rule, query_begin + live - 1, span).last;
  }
  const std::int64_t tile_begin = key_begin / kKeyTile;
  const std::int64_t tile_end = key_end > key_begin ? (key_end + kKeyTile - 1) / kKeyTile : 0;

  for (std::int64_t h = 0; h < g.heads; ++h) {
    const HeadOperands& op = heads[static_cast<std::size_t>(h)];
    const std::int64_t stats_row = (b * g.heads + h) * Nq + query_begin;
    if (live > 0) {
      std::fill(s.running_max.begin(), s.running_max.end(), kNegInf);
      std::fill(s.sums.data(), s.sums.data() + live_chunks * kLanes, 0.0f);
      std::fill(s.entropy_sums.data(), s.entropy_sums.data() + live_chunks * kLanes, 0.0f);
      for (std::int64_t t = tile_begin; t < tile_end; ++t) {
        const std::int64_t key0 = t * kKeyTile;
        const float* panel = op.panels + t * g.score_dim * kKeyTile;
        const float* values = op.values + key0 * g.value_stride;
        for (std::int64_t c = 0; c < live_chunks; c += kChunkRows) {
          const std::int64_t query0 = query_begin + c;
          const TileCover tile =
              cover(rule, span, query0, std::min(query0 + kChunkRows, query_begin + live), key0);
          if (tile == TileCover::empty) continue;
          const bool masked = tile == TileCover::partial;
          const std::int64_t chunk_live = std::min<std::int64_t>(kChunkRows, live - c);
          if (chunk_live == 1) {
            chunk_tile<1>(op, panel, values, c, query0, key0, masked, rule, span, g, s);
          } else if (chunk_live == 2 && kChunkRows > 2) {
            chunk_tile<2>(op, panel, values, c, query0, key0, masked, rule, span, g, s);
          } else if (chunk_live <= 4 && kChunkRows > 4) {
            chunk_tile<4>(op, panel, values, c, query0, key0, masked, rule, span, g, s);
          } else {
            chunk_tile<kChunkRows>(op, panel, values, c, query0, key0, masked, rule, span, g, s);
          }
        }
      }
    }

    // Normalise, record lse and entropy, and add this head's output to the update. A NaN score
    // needs no test of its own in the loops above: it makes exp(s - m), hence Z and O, NaN, which
    // the formulas below carry into lse, entropy and delta (+inf does the same through
    // inf - inf). Only a row that sees keys but whose running max stayed -inf (every visible
    // score NaN or -inf: the tiles then add nothing) must be made NaN here, or, in a partial
    // state, keep lse = -inf with H = NaN and O = 0 (partial.hpp). A row that sees no key gets
    // O = 0, lse = -inf, H = 0.
    for (std::int64_t r = 0; r < rows; ++r) {
      const bool sees = r < live && !keys_in(rule, query_begin + r, span).empty();
      const float m = sees ? s.running_max[static_cast<std::size_t>(r)] : kNegInf;
      float* o = s.head_output.data() + r * g.value_stride;
      float lse = kNegInf, entropy = 0.0f;
      if (!sees) {
        if (r < live_chunks) std::fill(o, o + g.value_stride, 0.0f);
      } else if (m == kNegInf) {
        entropy = std::numeric_limits<float>::quiet_NaN();
        if (!partial) lse = entropy;
        std::fill(o, o + g.value_stride, partial ? 0.0f : entropy);
        s.saw_key[static_cast<std::size_t>(r)] = 1;
      } else {
        const float z = horizontal_sum(load(s.sums.data() + r * kLanes));
        const float e = horizontal_sum(load(s.entropy_sums.data() + r * kLanes));
        const float log_z = std::log(z);
        lse = m + log_z;
        entropy = log_z - e / z;
        const Vec inv = splat(1.0f / z);
        for (std::int64_t a = 0; a < g.value_stride; a += kLanes) store(o + a, inv * load(o + a));
        s.saw_key[static_cast<std::size_t>(r)] = 1;
      }
      s.row_lse[static_cast<std::size_t>(r)] = lse;
      if (partial) {
        sink.partial.lse[stats_row + r] = lse;
        sink.partial.entropy[stats_row + r] = entropy;
        float* dst = sink.partial.heads + (stats_row + r) * g.dim;
        if (r < live_chunks) {
          std::copy(o, o + g.dim, dst);
        } else {
          std::fill(dst, dst + g.dim, 0.0f);
        }
        continue;
      }
      if (out.lse) out.lse[stats_row + r] = lse;
      if (out.entropy) out.entropy[stats_row + r] = entropy;
    }
    if (live > 0 && !partial) {
      float* o = s.head_output.data();
      if (layer.output_map == nullptr) {
        for (std::int64_t i = 0; i < live_chunks * g.dim_stride; i += kLanes) {
          store(update + i, load(update + i) + load(o + i));
        }
      } else {
        const float* map = layer.output_map + h * g.value_dim * g.dim_stride;
        for (std::int64_t r = 0; r < live_chunks; r += kContentRows) {
          row_block_gemm<kContentRows>(g.value_dim, o + r * g.value_stride, g.value_stride, map,
                                       g.dim_stride, g.dim_stride, update + r * g.dim_stride,
                                       g.dim_stride, true);
        }
      }
    }

    // Weights need the Nq x N matrix anyway: recompute each score tile and write exp(s - lse).
    if (out.weights != nullptr && !partial) {
      for (std::int64_t r = 0; r < rows; ++r) {
        float* w = out.weights + (stats_row + r) * N;
        std::fill(w, w + N, 0.0f);
      }
      for (std::int64_t c = 0; c < live_chunks; c += kChunkRows) {
        const std::int64_t query0 = query_begin + c;
        const std::int64_t chunk_end = std::min(query0 + kChunkRows, query_begin + live);
        for (std::int64_t t = 0; t * kKeyTile < N; ++t) {
          const std::int64_t key0 = t * kKeyTile;
          if (cover(rule, span, query0, chunk_end, key0) == TileCover::empty) continue;
          float* scores = s.scores.data();
          row_block_gemm<kChunkRows>(g.score_dim, op.queries + query0 * g.score_stride,
                                     g.score_stride, op.panels + t * g.score_dim * kKeyTile,
                                     kKeyTile, kKeyTile, scores, kKeyTile, false);
          for (std::int64_t i = query0; i < chunk_end; ++i) {
            const float lse = s.row_lse[static_cast<std::size_t>(i - query_begin)];
            float* w = out.weights + (stats_row + i - query_begin) * N;
            const float* row = scores + (i - query0) * kKeyTile - key0;
            const KeyRange keys = keys_in(rule, i, span);
            for (std::int64_t j = key0; j < std::min(key0 + kKeyTile, N); ++j) {
              if (keys.contains(j)) w[j] = std::exp(row[j] - lse);
            }
          }
        }
      }
    }
  }
  if (partial) return;

  // delta_i = sum_h (...) + c for every query that saw a key; 0 for the others.
  for (std::int64_t r = 0; r < rows; ++r) {
    float* dst = out.update + (b * Nq + query_begin + r) * g.dim;
    const float* src = update + r * g.dim_stride;
    if (!s.saw_key[static_cast<std::size_t>(r)]) {
      std::fill(dst, dst + g.dim, 0.0f);
    } else if (layer.offset != nullptr) {
      for (std::int64_t a = 0; a < g.dim; ++a) dst[a] = src[a] + layer.offset[a];
    } else {
      std::copy(src, src + g.dim, dst);
    }
  }
}

}  // namespace engine
EMFLOW_CPU_END
