// Internal to the fused CPU engine (engine.cpp, engine_block.cpp): its tile sizes, its working
// memory and the shapes and operands its two phases share.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "core/check.hpp"
#include "engine.hpp"
#include "simd.hpp"
#include "target.hpp"

EMFLOW_CPU_BEGIN
namespace engine {

inline constexpr std::int64_t kKeyTile = 32;     // keys per score tile
inline constexpr std::int64_t kTokenAlign = 64;  // buffers hold the tokens rounded up to this
#if EMFLOW_CPU_LANES == 16
inline constexpr int kChunkRows = 8;  // 8 x 32 scores = 16 accumulators of 16 lanes
#else
inline constexpr int kChunkRows = 4;
#endif
inline constexpr int kContentRows = kChunkRows;  // rows per content micro-kernel call (O += P V)
inline constexpr std::int64_t kProjectionRows = 4;
inline constexpr float kNegInf = -std::numeric_limits<float>::infinity();

static_assert(kTokenAlign % kKeyTile == 0 && kTokenAlign % kChunkRows == 0, "tile sizes");

/// Zero-filled float storage aligned to a cache line, freed with the object; `zeroed` false
/// leaves it unwritten, for storage that every reader writes first (its pages are then first
/// touched by the threads that use them, not all by the allocating one).
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  explicit AlignedBuffer(std::int64_t count, bool zeroed = true) {
    const std::size_t bytes = (static_cast<std::size_t>(count) * sizeof(float) + 63) / 64 * 64;
    if (bytes == 0) return;
    data_.reset(static_cast<float*>(std::aligned_alloc(64, bytes)));
    if (!data_) {
      fail(ErrorCode::out_of_memory, "attend: could not allocate ", bytes,
           " bytes of CPU working memory");
    }
    if (zeroed) std::memset(data_.get(), 0, bytes);
  }
  float* data() const { return data_.get(); }

 private:
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  std::unique_ptr<float, Free> data_;
};

inline std::int64_t round_up(std::int64_t n, std::int64_t multiple) {
  return (n + multiple - 1) / multiple * multiple;
}

/// The shapes every task shares.
struct Geometry {
  std::int64_t tokens = 0, padded_tokens = 0, dim = 0, heads = 0;  // keys
  std::int64_t query_tokens = 0, padded_queries = 0;
  std::int64_t score_dim = 0, score_stride = 0;  // query rows, key panels
  std::int64_t value_dim = 0, value_stride = 0;
  std::int64_t dim_stride = 0;  // update rows
  std::int64_t query_block = 64;
  bool shared_keys = true;
  std::int64_t query_floats() const { return padded_queries * score_stride; }
  std::int64_t key_floats() const { return padded_tokens * score_dim; }
  std::int64_t value_floats() const { return padded_tokens * value_stride; }
};

/// Per-thread working memory: O(query_block x (value_dim + dim)) floats.
struct Scratch {
  AlignedBuffer head_output;       // O: query_block x value_stride
  AlignedBuffer update;            // delta: query_block x dim_stride
  AlignedBuffer scores;            // S, then P: kChunkRows x kKeyTile
  AlignedBuffer sums;              // Z per lane: query_block x kLanes
  AlignedBuffer entropy_sums;      // E per lane: query_block x kLanes
  AlignedBuffer projected;         // one block of projected keys: kTokenAlign x score_stride
  AlignedBuffer rows;              // kProjectionRows cloud rows, zero padded
  std::vector<float> running_max;  // m: query_block
  std::vector<float> row_lse;      // lse of the current head: query_block
  std::vector<char> saw_key;       // per query row: some head had a visible key

  explicit Scratch(const Geometry& g)
      : head_output(g.query_block * g.value_stride),
        update(g.query_block * g.dim_stride),
        scores(kChunkRows * kKeyTile),
        sums(g.query_block * kLanes),
        entropy_sums(g.query_block * kLanes),
        projected(g.shared_keys ? 0 : kTokenAlign * g.score_stride),
        rows(kProjectionRows * g.dim),
        running_max(static_cast<std::size_t>(g.query_block)),
        row_lse(static_cast<std::size_t>(g.query_block)),
        saw_key(static_cast<std::size_t>(g.query_block)) {}
};

/// The operands of one head of one cloud.
struct HeadOperands {
  float* queries;  // padded_queries x score_stride
  float* panels;   // padded_tokens / kKeyTile panels of score_dim x kKeyTile
  float* values;   // padded_tokens x value_stride
};

/// The keys [first, last) that a task of phase 2 meets (all of them unless split).
struct KeySpan {
  std::int64_t first = 0;
  std::int64_t last = 0;
};

/// Attention of the queries [query_begin, query_begin + g.query_block) of cloud `b` (all heads)
/// against the projected operands `heads` over the keys of `span`, written to `out` (its
/// partial state when out.partial.heads is set: rows (b H + h) Nq + i, as partial.hpp lays them
/// out) (phase 2, engine_block.cpp).
void attend_block(std::int64_t b, std::int64_t query_begin, const Geometry& g,
                  const std::vector<HeadOperands>& heads, const EngineLayer& layer,
                  const QueryRule& rule, KeySpan span, const EngineOutput& out, Scratch& s);

/// How phase 2 divides the work: query blocks of `query_block` rows and, when the query blocks
/// are few, the keys into `spans` spans of `span_keys` keys (whole tiles) whose partial states
/// phase 3 merges. Follows from the shape (and, for the query block without a split, the team
/// size, which the results do not depend on).
struct SpanPlan {
  std::int64_t query_block = 64;
  std::int64_t blocks = 1;  ///< query blocks per cloud
  std::int64_t spans = 1;
  std::int64_t span_keys = 0;
};

SpanPlan plan_spans(const Geometry& g, std::int64_t group, bool split, int team);

/// The partial states of every span of a group when the keys are split (empty otherwise):
/// (span, cloud of the group, head, query, dim) as partial.hpp lays them out.
struct SpanStates {
  std::int64_t rows = 0;  ///< per span: group H Nq
  AlignedBuffer heads, lse, entropy;
  SpanStates(const Geometry& g, std::int64_t group, const SpanPlan& plan);
};

/// Phases 2 and 3 for the clouds [first, first + count) (rules: theirs, from `first`), run by
/// every thread of an enclosing parallel region: attention tasks of (cloud, query block, span),
/// then, when split, the merge of the spans and the finished update or partial state.
void attend_tasks(const Geometry& g, const SpanPlan& plan, const QueryRule* rules,
                  std::int64_t first, std::int64_t count,
                  const std::vector<std::vector<HeadOperands>>& operands, const EngineLayer& layer,
                  const EngineOutput& out, SpanStates& states, Scratch& s);

}  // namespace engine
EMFLOW_CPU_END
