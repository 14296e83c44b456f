// Phases 2 and 3 of the fused CPU engine (see engine.cpp): the attention tasks and, when the
// queries are few, the split of the keys into spans whose partial states are merged exactly
// (docs/MATH.md §1.6), as flash-decoding does, so that a handful of queries against a long cloud
// keeps every thread busy.
#include <omp.h>

#include <algorithm>
#include <vector>

#include "core/partial_rows.hpp"
#include "engine_internal.hpp"
#include "target.hpp"

EMFLOW_CPU_BEGIN
namespace engine {

namespace {
// Split only below this many query blocks in a group, into spans of at least this many keys (a
// span's merge costs O(Nq d), its attention O(Nq span d)).
constexpr std::int64_t kSplitBelowBlocks = 8;
constexpr std::int64_t kMinSpanKeys = 2048;
}  // namespace

SpanPlan plan_spans(const Geometry& g, std::int64_t group, bool split, int team) {
  SpanPlan plan;
  const std::int64_t Nq = g.query_tokens, tokens = g.tokens;
  const std::int64_t wide_blocks = group * ((Nq + 63) / 64);
  if (split && wide_blocks < kSplitBelowBlocks) {
    plan.spans = std::min<std::int64_t>((2 * kSplitBelowBlocks + wide_blocks - 1) / wide_blocks,
                                        tokens / kMinSpanKeys);
    plan.spans = std::max<std::int64_t>(plan.spans, 1);
  }
  plan.span_keys = round_up((tokens + plan.spans - 1) / plan.spans, kKeyTile);
  if (plan.spans > 1) plan.spans = (tokens + plan.span_keys - 1) / plan.span_keys;
  if (plan.spans > 1) {
    plan.query_block = std::min<std::int64_t>(64, round_up(Nq, kChunkRows));
  } else {
    // Smaller query blocks when there are few, so every thread gets work; the results do not
    // depend on the block size (rows are computed independently, tiles in the same order).
    plan.query_block = 64;
    while (plan.query_block > kChunkRows && wide_blocks * (64 / plan.query_block) < 4 * team) {
      plan.query_block /= 2;
    }
  }
  plan.blocks = (Nq + plan.query_block - 1) / plan.query_block;
  return plan;
}

SpanStates::SpanStates(const Geometry& g, std::int64_t group, const SpanPlan& plan)
    : rows(plan.spans > 1 ? group * g.heads * g.query_tokens : 0),
      heads(plan.spans * rows * g.dim),
      lse(plan.spans * rows),
      entropy(plan.spans * rows) {}

void attend_tasks(const Geometry& g, const SpanPlan& plan, const QueryRule* rules,
                  std::int64_t first, std::int64_t count,
                  const std::vector<std::vector<HeadOperands>>& operands, const EngineLayer& layer,
                  const EngineOutput& out, SpanStates& states, Scratch& s) {
  const std::int64_t spans = plan.spans, blocks = plan.blocks, Nq = g.query_tokens;
  const std::int64_t H = g.heads;
  const bool partial = out.partial.heads != nullptr;
  // Phase 2: one block of queries of one cloud (and one span of keys) per task, the last blocks
  // first (under a causal mask they have the most keys).
  const std::int64_t attention_tasks = count * blocks * spans;
#pragma omp for schedule(dynamic, 1)
  for (std::int64_t task = 0; task < attention_tasks; ++task) {
    const std::int64_t span = task % spans;
    const std::int64_t c = (task / spans) % count;
    const std::int64_t block = blocks - 1 - task / (spans * count);
    const QueryRule& rule = rules[c];
    const auto& heads = operands[static_cast<std::size_t>(c)];
    if (spans == 1) {
      attend_block(first + c, block * g.query_block, g, heads, layer, rule, {0, g.tokens}, out, s);
      continue;
    }
    EngineOutput state;
    state.partial = {states.heads.data() + span * states.rows * g.dim,
                     states.lse.data() + span * states.rows,
                     states.entropy.data() + span * states.rows};
    const KeySpan keys{span * plan.span_keys, std::min(g.tokens, (span + 1) * plan.span_keys)};
    attend_block(c, block * g.query_block, g, heads, layer, rule, keys, state, s);
  }
  if (spans == 1) return;

    // Phase 3: merge the spans of each query in order 0, 1, ..., then write the partial state or
    // finish the update.
#pragma omp for schedule(static)
  for (std::int64_t task = 0; task < count * Nq; ++task) {
    const std::int64_t c = task / Nq, i = task % Nq, b = first + c;
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t row = (c * H + h) * Nq + i;
      float* lse = states.lse.data() + row;
      float* entropy = states.entropy.data() + row;
      float* o = states.heads.data() + row * g.dim;
      for (std::int64_t k = 1; k < spans; ++k) {
        const std::int64_t other = k * states.rows + row;
        merge_state(*lse, *entropy, o, states.lse.data()[other], states.entropy.data()[other],
                    states.heads.data() + other * g.dim, g.dim);
      }
      if (partial) {
        const std::int64_t dst = (b * H + h) * Nq + i;
        out.partial.lse[dst] = *lse;
        out.partial.entropy[dst] = *entropy;
        std::copy(o, o + g.dim, out.partial.heads + dst * g.dim);
      }
    }
    if (partial) continue;
    const std::int64_t row = c * H * Nq + i, dst = b * H * Nq + i;
    finish_query(H, Nq, states.lse.data() + row, states.entropy.data() + row,
                 states.heads.data() + row * g.dim, g.dim, layer.offset,
                 out.attend.update + (b * Nq + i) * g.dim,
                 out.attend.lse ? out.attend.lse + dst : nullptr,
                 out.attend.entropy ? out.attend.entropy + dst : nullptr);
  }
}

}  // namespace engine
EMFLOW_CPU_END
