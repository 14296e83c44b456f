// The fused float32 attention engine of the fast CPU backend (see engine.hpp for what it
// computes). How it computes it:
//
// Phase 1 (projections, O(N d^2) per head): queries Q_h, values V_h and, for the factored form,
// keys K_h are computed by the register-blocked micro-kernel of simd.hpp, one 64-row block of a
// cloud per task. Keys are stored transposed, in panels of kKeyTile keys (score_dim x kKeyTile),
// so a score tile is again a small GEMM with contiguous vector loads. For the dense form the keys
// are the cloud itself and one set of panels serves every head.
//
// Phase 2 (attention, O(N^2 d) per head, O(N d) memory, in engine_block.cpp): one task per
// (cloud, block of queries). For each head in order 0..H-1, the block's queries meet the key
// tiles one at a time, kChunkRows queries at a time: a score tile (kChunkRows x kKeyTile) by the
// micro-kernel, an online softmax (running max m, a per-lane running sum Z and a per-lane running
// sum E of p (s - m) for the entropy, all rescaled when m grows), and the content step O += P V_h
// by the micro-kernel. Key tiles wholly outside the mask are skipped; tiles wholly inside it need
// no masking. The normalised head outputs are summed into the block's update in head order, so
// every output element is computed by one thread in one fixed order: results are bitwise identical
// whatever the thread count and the schedule.
//
// Entropy is computed as H_i = log Z_i - E_i / Z_i with E_i = sum_j exp(s_ij - m_i)(s_ij - m_i):
// both terms are non-negative, so no cancellation happens where lse_i is large.
#include "engine.hpp"

#include <omp.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "engine_internal.hpp"
#include "simd.hpp"
#include "target.hpp"

EMFLOW_CPU_BEGIN

using namespace engine;  // the tile sizes, buffers and shapes shared with engine_block.cpp

namespace {

// Bytes of projected operands to hold at once; clouds are processed in groups within it.
constexpr std::int64_t kGroupBytes = std::int64_t{96} << 20;

/// out[rows x columns] = X[rows x dim] map[dim x columns] (+ bias) for the cloud rows
/// [row_begin, row_begin + rows) of a cloud whose first `tokens` rows are read; rows past those
/// read as zero (written as 0 within the last group of kProjectionRows, otherwise left as they
/// are in `out`).
void project(const float* cloud, std::int64_t tokens, std::int64_t dim, std::int64_t row_begin,
             std::int64_t rows, const float* map, std::int64_t columns, const float* bias,
             float* out, float* row_scratch) {
  for (std::int64_t r = 0; r < rows; r += kProjectionRows) {
    const std::int64_t first = row_begin + r;
    if (first >= tokens) break;
    const float* A = cloud + first * dim;
    if (first + kProjectionRows > tokens) {
      std::fill(row_scratch, row_scratch + kProjectionRows * dim, 0.0f);
      std::copy(A, cloud + tokens * dim, row_scratch);
      A = row_scratch;
    }
    row_block_gemm<kProjectionRows>(dim, A, dim, map, columns, columns, out + r * columns, columns,
                                    false);
    if (bias != nullptr) {
      const std::int64_t valid = std::min(kProjectionRows, tokens - first);
      for (std::int64_t i = 0; i < valid; ++i) {
        float* row = out + (r + i) * columns;
        for (std::int64_t a = 0; a < columns; a += kLanes) {
          store(row + a, load(row + a) + load(bias + a));
        }
      }
    }
  }
}

/// Copies keys [key_begin, key_begin + count) (rows of a row-major matrix with `stride`) into the
/// transposed panels: panel t holds keys [t kKeyTile, (t + 1) kKeyTile) as score_dim x kKeyTile.
void pack_keys(const float* keys, std::int64_t stride, std::int64_t score_dim,
               std::int64_t key_begin, std::int64_t count, float* panels) {
  for (std::int64_t j = 0; j < count; ++j) {
    const std::int64_t key = key_begin + j;
    float* panel = panels + (key / kKeyTile) * score_dim * kKeyTile + key % kKeyTile;
    const float* row = keys + j * stride;
    for (std::int64_t k = 0; k < score_dim; ++k) panel[k * kKeyTile] = row[k];
  }
}

/// The shapes of `query_tokens` queries against `tokens` keys under `layer`, padded to the
/// tiles; shared_keys: one set of key panels serves every head.
Geometry geometry(std::int64_t tokens, std::int64_t query_tokens, const EngineLayer& layer,
                  bool shared_keys) {
  Geometry g;
  g.tokens = tokens;
  g.padded_tokens = round_up(tokens, kTokenAlign);
  g.query_tokens = query_tokens;
  g.padded_queries = round_up(query_tokens, kTokenAlign);
  g.dim = layer.dim;
  g.heads = layer.heads;
  g.score_dim = layer.score_dim;
  g.score_stride = padded_columns(layer.score_dim);
  g.value_dim = layer.value_dim;
  g.value_stride = padded_columns(layer.value_dim);
  g.dim_stride = padded_columns(layer.dim);
  g.shared_keys = shared_keys;
  return g;
}

}  // namespace

std::int64_t padded_columns(std::int64_t columns) { return round_to_lanes(columns); }

std::vector<QueryRule> self_rules(std::int64_t batch, std::int64_t tokens, const Mask& mask,
                                  const std::int64_t* key_lengths) {
  std::vector<QueryRule> rules(static_cast<std::size_t>(batch));
  for (std::int64_t b = 0; b < batch; ++b) {
    QueryRule& rule = rules[static_cast<std::size_t>(b)];
    rule.mask = mask;
    rule.key_length = rule.query_length = key_lengths ? key_lengths[b] : tokens;
  }
  return rules;
}

void fused_attend(const EngineClouds& clouds, const EngineLayer& layer, const EngineOutput& out,
                  int threads) {
  const std::int64_t batch = clouds.batch, tokens = clouds.tokens;
  Geometry g = geometry(tokens, clouds.query_tokens, layer, layer.key_map == nullptr);
  const std::int64_t Nq = g.query_tokens;

  // With the thread count left to us, small calls run on one thread: waking a team costs a few
  // microseconds on an idle machine and up to a scheduler time slice on a busy one, more than
  // a call of a few MFLOP takes alone.
  const double work = 4.0 * static_cast<double>(batch) * static_cast<double>(layer.heads) *
                      static_cast<double>(Nq) * static_cast<double>(tokens) *
                      static_cast<double>(layer.score_dim + layer.value_dim) / 2.0;
  constexpr double kSmallCallFlop = 4e6;
  const int team = threads > 0 ? threads : work < kSmallCallFlop ? 1 : omp_get_max_threads();
  const std::int64_t H = g.heads;
  const std::int64_t key_sets = g.shared_keys ? 1 : layer.key_sets > 0 ? layer.key_sets : H;
  const std::int64_t value_sets = layer.value_sets > 0 ? layer.value_sets : H;
  const std::int64_t key_group = H / key_sets, value_group = H / value_sets;
  // Rotary positions: cos and sin of every query's and key's angles, per cloud of a group.
  const RotaryCall* rotary = layer.rotary;
  const std::int64_t angle_floats = rotary != nullptr ? rotary->dim : 0;  // cos, then sin
  const std::int64_t table_floats = angle_floats * (g.padded_queries + g.padded_tokens);
  const std::int64_t cloud_floats = H * g.query_floats() + value_sets * g.value_floats() +
                                    key_sets * g.key_floats() + table_floats;
  const std::int64_t group = std::clamp<std::int64_t>(kGroupBytes / (4 * cloud_floats), 1, batch);

  const SpanPlan plan = plan_spans(
      g, group, clouds.split_keys && out.attend.weights == nullptr && layer.output_map == nullptr,
      team);
  g.query_block = plan.query_block;
  AlignedBuffer queries(group * H * g.query_floats());
  AlignedBuffer panels(group * key_sets * g.key_floats());
  AlignedBuffer values(group * value_sets * g.value_floats());
  AlignedBuffer angles(group * table_floats);
  std::vector<std::unique_ptr<Scratch>> scratch;
  for (int t = 0; t < team; ++t) scratch.push_back(std::make_unique<Scratch>(g));
  SpanStates states(g, group, plan);
  auto operands = [&](std::int64_t local_cloud) {
    std::vector<HeadOperands> heads(static_cast<std::size_t>(H));
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t head_set = local_cloud * H + h;
      const std::int64_t key_set = local_cloud * key_sets + h / key_group;
      const std::int64_t value_set = local_cloud * value_sets + h / value_group;
      heads[static_cast<std::size_t>(h)] = {queries.data() + head_set * g.query_floats(),
                                            panels.data() + key_set * g.key_floats(),
                                            values.data() + value_set * g.value_floats()};
    }
    return heads;
  };

  const std::int64_t projection_blocks = std::max(g.padded_tokens, g.padded_queries) / kTokenAlign;
  for (std::int64_t first = 0; first < batch; first += group) {
    const std::int64_t count = std::min(group, batch - first);
    std::vector<std::vector<HeadOperands>> cloud_operands;
    for (std::int64_t c = 0; c < count; ++c) cloud_operands.push_back(operands(c));

#pragma omp parallel num_threads(team)
    {
      Scratch& s = *scratch[static_cast<std::size_t>(omp_get_thread_num())];
      // Phase 0 (rotary positions only): the cos and sin of every row's angles, one 64-row
      // block of one cloud per task, computed once and read by every head.
      const auto query_angles = [&](std::int64_t c, std::int64_t i) {
        return angles.data() + c * table_floats + i * angle_floats;
      };
      const auto key_angles = [&](std::int64_t c, std::int64_t j) {
        return angles.data() + c * table_floats + (g.padded_queries + j) * angle_floats;
      };
      if (rotary != nullptr) {
        const std::int64_t half = rotary->dim / 2;
#pragma omp for schedule(static)
        for (std::int64_t task = 0; task < count * projection_blocks; ++task) {
          const std::int64_t c = task / projection_blocks;
          const std::int64_t row0 = (task % projection_blocks) * kTokenAlign;
          const QueryRule& rule = clouds.rules[first + c];
          for (std::int64_t i = row0; i < std::min(row0 + kTokenAlign, Nq); ++i) {
            float* angle = query_angles(c, i);
            rotary->angles(rotary->query_position(first + c, rule, i), angle, angle + half);
          }
          for (std::int64_t j = row0; j < std::min(row0 + kTokenAlign, tokens); ++j) {
            float* angle = key_angles(c, j);
            rotary->angles(rotary->key_position(first + c, rule, j), angle, angle + half);
          }
        }  // the implicit barrier: every table is written before a head reads it
      }
      // Rotates `rows` projected rows (row stride `stride`) from row `first_row` by `angle_of`.
      const auto rotate_rows = [&](float* rows, std::int64_t stride, std::int64_t first_row,
                                   std::int64_t count_rows, auto angle_of) {
        const std::int64_t half = rotary->dim / 2;
        for (std::int64_t k = 0; k < count_rows; ++k) {
          const float* angle = angle_of(first_row + k);
          rotary->rotate(rows + k * stride, angle, angle + half);
        }
      };

      // Phase 1: projections, one 64-row block of one head of one cloud per task (dynamic, so a
      // thread that the OS holds back does not hold back the others).
      const std::int64_t projection_tasks = count * H * projection_blocks;
#pragma omp for schedule(dynamic, 1)
      for (std::int64_t task = 0; task < projection_tasks; ++task) {
        const std::int64_t c = task / (H * projection_blocks);
        const std::int64_t h = (task / projection_blocks) % H;
        const std::int64_t row0 = (task % projection_blocks) * kTokenAlign;
        const float* X = clouds.keys + (first + c) * tokens * g.dim;
        const float* Q = clouds.queries + (first + c) * Nq * g.dim;
        const HeadOperands& op = cloud_operands[static_cast<std::size_t>(c)][h];
        const float* bias = layer.query_bias ? layer.query_bias + h * g.score_stride : nullptr;
        if (row0 < g.padded_queries) {
          float* rows = op.queries + row0 * g.score_stride;
          project(Q, Nq, g.dim, row0, kTokenAlign, layer.query_map + h * g.dim * g.score_stride,
                  g.score_stride, bias, rows, s.rows.data());
          if (rotary != nullptr && row0 < Nq) {
            rotate_rows(rows, g.score_stride, row0, std::min(kTokenAlign, Nq - row0),
                        [&](std::int64_t i) { return query_angles(c, i); });
          }
        }
        if (row0 >= g.padded_tokens) continue;
        // Values of keys past the key length are never weighted; they stay 0 (or finite from an
        // earlier cloud), so whatever the caller left in the padding cannot turn 0 * v into NaN.
        // A value set (and a key set) is projected by the first head of the group sharing it.
        const std::int64_t length = clouds.rules[first + c].key_length;
        if (h % value_group == 0) {
          project(X, length, g.dim, row0, kTokenAlign,
                  layer.value_map + (h / value_group) * g.dim * g.value_stride, g.value_stride,
                  nullptr, op.values + row0 * g.value_stride, s.rows.data());
        }
        const std::int64_t valid = std::min(kTokenAlign, tokens - row0);
        if (valid <= 0) continue;
        if (g.shared_keys) {
          if (h == 0) {
            pack_keys(X + row0 * g.dim, g.dim, g.score_dim, row0, valid, op.panels);
          }
        } else if (h % key_group == 0) {
          project(X, tokens, g.dim, row0, kTokenAlign,
                  layer.key_map + (h / key_group) * g.dim * g.score_stride, g.score_stride, nullptr,
                  s.projected.data(), s.rows.data());
          if (rotary != nullptr) {
            rotate_rows(s.projected.data(), g.score_stride, row0, valid,
                        [&](std::int64_t j) { return key_angles(c, j); });
          }
          pack_keys(s.projected.data(), g.score_stride, g.score_dim, row0, valid, op.panels);
        }
      }

      // Phases 2 and 3 (engine_spans.cpp).
      attend_tasks(g, plan, clouds.rules + first, first, count, cloud_operands, layer, out, states,
                   s);
    }
  }
}

EMFLOW_CPU_END

EMFLOW_CPU_BEGIN

using namespace engine;

std::int64_t key_tile() { return kKeyTile; }

void pack_key_rows(const float* rows, std::int64_t dim, std::int64_t first, std::int64_t count,
                   float* panels) {
  pack_keys(rows, dim, dim, first, count, panels);
}

void project_rows(const float* rows, std::int64_t count, std::int64_t dim, const float* map,
                  std::int64_t columns, float* out) {
  std::vector<float> scratch(static_cast<std::size_t>(kProjectionRows * dim));
  project(rows, count, dim, 0, round_up(count, kProjectionRows), map, columns, nullptr, out,
          scratch.data());
}

void attend_cached(const float* queries, std::int64_t query_tokens, const QueryRule& rule,
                   const CachedOperands& keys, const EngineLayer& layer,
                   const AttentionOutput<float>& out, int threads) {
  Geometry g = geometry(keys.tokens, query_tokens, layer, true);
  const double work = 4.0 * static_cast<double>(layer.heads) * static_cast<double>(query_tokens) *
                      static_cast<double>(keys.tokens) * static_cast<double>(layer.dim);
  const int team = threads > 0 ? threads : work < 4e6 ? 1 : omp_get_max_threads();
  const SpanPlan plan = plan_spans(g, 1, true, team);
  g.query_block = plan.query_block;

  // Only the queries are projected here; the keys and contents are the cache's.
  const std::int64_t H = g.heads;
  AlignedBuffer projected(H * g.query_floats());
  std::vector<std::vector<HeadOperands>> operands(1);
  std::vector<float> rows(static_cast<std::size_t>(kProjectionRows * g.dim));
  for (std::int64_t h = 0; h < H; ++h) {
    float* q = projected.data() + h * g.query_floats();
    const float* bias = layer.query_bias ? layer.query_bias + h * g.score_stride : nullptr;
    project(queries, query_tokens, g.dim, 0, g.padded_queries,
            layer.query_map + h * g.dim * g.score_stride, g.score_stride, bias, q, rows.data());
    operands[0].push_back({q, const_cast<float*>(keys.panels),
                           const_cast<float*>(keys.values[static_cast<std::size_t>(h)])});
  }
  std::vector<std::unique_ptr<Scratch>> scratch;
  for (int t = 0; t < team; ++t) scratch.push_back(std::make_unique<Scratch>(g));
  SpanStates states(g, 1, plan);
  EngineOutput sink;
  sink.attend = out;
#pragma omp parallel num_threads(team)
  {
    Scratch& s = *scratch[static_cast<std::size_t>(omp_get_thread_num())];
    attend_tasks(g, plan, &rule, 0, 1, operands, layer, sink, states, s);
  }
}

EMFLOW_CPU_END
