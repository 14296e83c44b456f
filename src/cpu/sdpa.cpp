// The forward pass of the SDPA-shaped operator (include/emflow/sdpa.hpp) on the fused CPU engine.
//
// The operator is the engine's phase 2 and 3 (engine_block.cpp, engine_spans.cpp) with nothing
// to project: each (cloud, query head) is one engine cloud of one head, whose queries are
// scale * q_i (packed into the engine's padded rows), whose key panels and value rows are those
// of its key and value head g = h / (Hq / Hkv), packed once and shared by the query heads of the
// group, and whose update is the head's output o_i (the identity output map). So the online
// softmax, the tile masks, the split of the keys when the queries are few and the bitwise
// independence of the thread count are the engine's own.
#include "sdpa.hpp"

#include <omp.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "core/dispatch.hpp"
#include "engine_internal.hpp"
#include "target.hpp"

EMFLOW_CPU_BEGIN

using namespace engine;

namespace {

// Bytes of packed operands to hold at once; clouds are processed in groups within it.
constexpr std::int64_t kGroupBytes = std::int64_t{96} << 20;
constexpr double kSmallCallFlop = 4e6;

/// The engine's shapes for one (cloud, query head) of `a`: one head, the output its update.
Geometry sdpa_geometry(const SdpaArrays& a) {
  Geometry g;
  g.tokens = a.tokens;
  g.padded_tokens = round_up(a.tokens, kTokenAlign);
  g.query_tokens = a.query_tokens;
  g.padded_queries = round_up(a.query_tokens, kTokenAlign);
  g.dim = a.value_rank;
  g.heads = 1;
  g.score_dim = a.rank;
  g.score_stride = padded_columns(a.rank);
  g.value_dim = a.value_rank;
  g.value_stride = padded_columns(a.value_rank);
  g.dim_stride = padded_columns(a.value_rank);
  g.shared_keys = true;
  return g;
}

}  // namespace

void pack_query_rows(const float* rows, std::int64_t width, float scale, const QueryRule& rule,
                     std::int64_t row0, std::int64_t row_end, float* out, std::int64_t stride) {
  for (std::int64_t i = row0; i < row_end; ++i) {
    float* row = out + i * stride;
    if (rule.keys(i).empty()) {
      std::fill(row, row + width, 0.0f);
    } else {
      for (std::int64_t k = 0; k < width; ++k) row[k] = scale * rows[i * width + k];
    }
  }
}

void pack_real_rows(const float* rows, std::int64_t width, std::int64_t length, std::int64_t row0,
                    std::int64_t row_end, float* out, std::int64_t stride) {
  for (std::int64_t j = row0; j < row_end; ++j) {
    float* row = out + j * stride;
    if (j < length) {
      std::copy(rows + j * width, rows + (j + 1) * width, row);
    } else {
      std::fill(row, row + width, 0.0f);
    }
  }
}

void pack_real_panels(const float* rows, std::int64_t width, std::int64_t length, std::int64_t row0,
                      std::int64_t row_end, float* panels) {
  for (std::int64_t j = row0; j < row_end; ++j) {
    float* panel = panels + (j / kKeyTile) * width * kKeyTile + j % kKeyTile;
    if (j < length) {
      const float* row = rows + j * width;
      for (std::int64_t k = 0; k < width; ++k) panel[k * kKeyTile] = row[k];
    } else {
      for (std::int64_t k = 0; k < width; ++k) panel[k * kKeyTile] = 0.0f;
    }
  }
}

bool sdpa_inputs_finite(const SdpaArrays& a) {
  const std::int64_t Nq = a.query_tokens, Nk = a.tokens, r = a.rank, rv = a.value_rank;
  for (std::int64_t b = 0; b < a.batch; ++b) {
    const QueryRule& rule = a.rules[b];
    for (std::int64_t h = 0; h < a.query_heads; ++h) {
      const float* q = a.queries + (b * a.query_heads + h) * Nq * r;
      for (std::int64_t i = 0; i < rule.query_length; ++i) {
        if (!rule.keys(i).empty() && !all_finite(q + i * r, r)) return false;
      }
    }
    for (std::int64_t g = 0; g < a.kv_heads; ++g) {
      const std::int64_t set = b * a.kv_heads + g;
      if (!all_finite(a.keys + set * Nk * r, rule.key_length * r) ||
          !all_finite(a.values + set * Nk * rv, rule.key_length * rv)) {
        return false;
      }
    }
  }
  return true;
}

void sdpa_forward(const SdpaArrays& a, float* output, float* lse, float* entropy, int threads) {
  Geometry g = sdpa_geometry(a);
  const std::int64_t B = a.batch, Hq = a.query_heads, Hkv = a.kv_heads, Nq = a.query_tokens,
                     Nk = a.tokens, r = a.rank, rv = a.value_rank;
  const double work = 2.0 * static_cast<double>(B * Hq) * static_cast<double>(Nq) *
                      static_cast<double>(Nk) * static_cast<double>(r + rv);
  const int team = threads > 0 ? threads : work < kSmallCallFlop ? 1 : omp_get_max_threads();

  // Per cloud of the batch: Hq query sets, Hkv key panels and value sets.
  const std::int64_t cloud_floats =
      Hq * g.query_floats() + Hkv * (g.key_floats() + g.value_floats());
  const std::int64_t group = std::clamp<std::int64_t>(kGroupBytes / (4 * cloud_floats), 1, B);
  const SpanPlan plan = plan_spans(g, group * Hq, /*split=*/true, team);
  g.query_block = plan.query_block;

  AlignedBuffer queries(group * Hq * g.query_floats());
  AlignedBuffer panels(group * Hkv * g.key_floats());
  AlignedBuffer values(group * Hkv * g.value_floats());
  std::vector<std::unique_ptr<Scratch>> scratch;
  for (int t = 0; t < team; ++t) scratch.push_back(std::make_unique<Scratch>(g));
  SpanStates states(g, group * Hq, plan);

  // The engine's clouds are the (cloud, query head) pairs, each with its cloud's rule.
  std::vector<QueryRule> rules(static_cast<std::size_t>(B * Hq));
  for (std::int64_t e = 0; e < B * Hq; ++e) rules[static_cast<std::size_t>(e)] = a.rules[e / Hq];
  EngineLayer layer;
  layer.heads = 1;
  layer.dim = layer.value_dim = rv;
  layer.score_dim = r;
  EngineOutput sink;
  sink.attend = AttentionOutput<float>{output, lse, entropy, nullptr};

  const std::int64_t query_blocks = g.padded_queries / kTokenAlign;
  const std::int64_t key_blocks = g.padded_tokens / kTokenAlign;
  for (std::int64_t first = 0; first < B; first += group) {
    const std::int64_t count = std::min(group, B - first);
    std::vector<std::vector<HeadOperands>> operands(static_cast<std::size_t>(count * Hq));
    for (std::int64_t c = 0; c < count; ++c) {
      for (std::int64_t h = 0; h < Hq; ++h) {
        const std::int64_t set = c * Hkv + h / a.group();
        operands[static_cast<std::size_t>(c * Hq + h)] = {
            {queries.data() + (c * Hq + h) * g.query_floats(), panels.data() + set * g.key_floats(),
             values.data() + set * g.value_floats()}};
      }
    }

#pragma omp parallel num_threads(team)
    {
      Scratch& s = *scratch[static_cast<std::size_t>(omp_get_thread_num())];
      // Packing, one 64-row block of one query set or of one key and value set per task: the
      // queries scaled, the real keys into panels and the real values into padded rows.
      const std::int64_t query_tasks = count * Hq * query_blocks;
      const std::int64_t tasks = query_tasks + count * Hkv * key_blocks;
#pragma omp for schedule(dynamic, 1)
      for (std::int64_t task = 0; task < tasks; ++task) {
        if (task < query_tasks) {
          const std::int64_t c = task / (Hq * query_blocks), h = (task / query_blocks) % Hq;
          const std::int64_t row0 = (task % query_blocks) * kTokenAlign;
          pack_query_rows(a.queries + ((first + c) * Hq + h) * Nq * r, r, a.scale,
                          a.rules[first + c], row0, std::min(row0 + kTokenAlign, Nq),
                          operands[static_cast<std::size_t>(c * Hq + h)][0].queries,
                          g.score_stride);
          continue;
        }
        const std::int64_t key_task = task - query_tasks;
        const std::int64_t c = key_task / (Hkv * key_blocks), kv = (key_task / key_blocks) % Hkv;
        const std::int64_t row0 = (key_task % key_blocks) * kTokenAlign;
        const std::int64_t row_end = std::min(row0 + kTokenAlign, Nk);
        const std::int64_t set = (first + c) * Hkv + kv, local = c * Hkv + kv;
        const std::int64_t length = a.rules[first + c].key_length;
        pack_real_panels(a.keys + set * Nk * r, r, length, row0, row_end,
                         panels.data() + local * g.key_floats());
        pack_real_rows(a.values + set * Nk * rv, rv, length, row0, row_end,
                       values.data() + local * g.value_floats(), g.value_stride);
      }
      attend_tasks(g, plan, rules.data() + first * Hq, first * Hq, count * Hq, operands, layer,
                   sink, states, s);
    }
  }
}

EMFLOW_CPU_END
