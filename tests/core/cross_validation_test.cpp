// Validation of cross-attention and of partial states: queries, query_tokens, query_lengths and
// positions are checked like every other argument (invalid_argument naming it), outputs of Nq
// rows must not overlap the queries, and attend_partial, merge_partial and finish_partial check
// their states. Each case starts from a valid cross-attention problem and breaks one thing.
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <limits>
#include <ostream>
#include <string>
#include <vector>

#include "common/testing.hpp"
#include "emflow/attention.hpp"
#include "emflow/error.hpp"
#include "emflow/partial.hpp"

namespace emflow {
namespace {

using testing::throws_error;

constexpr std::int64_t B = 2, N = 5, Nq = 3, d = 2, H = 2;

/// Two clouds of 5 keys and 3 queries in d = 2, two heads, causal, with key and query lengths.
struct Cross {
  std::vector<double> cloud, queries, relevance, content, update, lse, entropy, weights;
  std::vector<double> heads;
  std::vector<std::int64_t> key_lengths{5, 4}, query_lengths{3, 1};
  AttentionInput<double> input;
  AttentionOutput<double> output;
  PartialOutput<double> partial;

  Cross()
      : cloud(testing::uniform(B * N * d, 1)),
        queries(testing::uniform(B * Nq * d, 2)),
        relevance(testing::uniform(H * d * d, 3)),
        content(testing::uniform(H * d * d, 4)),
        update(B * Nq * d),
        lse(B * H * Nq),
        entropy(B * H * Nq),
        weights(B * H * Nq * N),
        heads(B * H * Nq * d) {
    input.cloud = cloud.data();
    input.batch = B;
    input.tokens = N;
    input.dim = d;
    input.layer = {H, relevance.data(), content.data(), nullptr, nullptr};
    input.mask = Mask::causal();
    input.key_lengths = key_lengths.data();
    input.queries = queries.data();
    input.query_tokens = Nq;
    input.query_lengths = query_lengths.data();
    output = {update.data(), lse.data(), entropy.data(), weights.data()};
    partial = {heads.data(), lse.data(), entropy.data()};
  }
};

enum Calls { both, attend_only, partial_only };

struct Case {
  std::string name, argument, detail;
  std::function<void(Cross&)> breaks;
  Calls calls = both;
};

std::ostream& operator<<(std::ostream& out, const Case& c) { return out << c.name; }

class CrossRejects : public ::testing::TestWithParam<Case> {};

TEST_P(CrossRejects, NamingTheArgument) {
  const Case& c = GetParam();
  for (int partial = 0; partial < 2; ++partial) {
    Cross x;
    auto call = [&] {
      if (partial) {
        attend_partial(x.input, x.partial, {Device::reference});
      } else {
        attend(x.input, x.output, {Device::reference});
      }
    };
    ASSERT_NO_THROW(call());
    c.breaks(x);
    if (c.calls == (partial ? attend_only : partial_only)) continue;
    EXPECT_TRUE(throws_error(call, ErrorCode::invalid_argument, {"'" + c.argument + "'", c.detail}))
        << (partial ? "attend_partial" : "attend");
  }
}

const std::int64_t kFar = std::int64_t{1} << 61;

INSTANTIATE_TEST_SUITE_P(
    Cases, CrossRejects,
    ::testing::Values(Case{"zero_query_tokens", "query_tokens", "got 0",
                           [](Cross& x) { x.input.query_tokens = 0; }},
                      Case{"self_query_tokens", "query_tokens", "must be 0 or tokens",
                           [](Cross& x) {
                             x.input.queries = nullptr;
                             x.input.query_lengths = nullptr;
                             x.input.query_tokens = 3;
                           }},
                      Case{"query_length_high", "query_lengths", "entry 1 must be in [0, 3], got 4",
                           [](Cross& x) { x.query_lengths[1] = 4; }},
                      Case{"query_length_negative", "query_lengths", "got -1",
                           [](Cross& x) { x.query_lengths[0] = -1; }},
                      Case{"queries_overflow", "queries", "overflows",
                           [](Cross& x) { x.input.query_tokens = std::int64_t{1} << 62; }},
                      Case{"key_position_far", "key_position", "2^60",
                           [](Cross& x) { x.input.key_position = kFar; }},
                      Case{"key_position_align_marker", "key_position", "2^60",
                           [](Cross& x) { x.input.key_position = kAlignToEnd; }},
                      Case{"query_position_far", "query_position", "2^60",
                           [](Cross& x) { x.input.query_position = -kFar; }},
                      Case{"update_overlaps_queries", "update", "queries",
                           [](Cross& x) { x.output.update = x.queries.data(); }, attend_only},
                      Case{"lse_overlaps_query_rows", "lse", "update",
                           [](Cross& x) { x.output.lse = x.update.data() + B * Nq * d - 1; },
                           attend_only},
                      Case{"weights_overlap_update", "weights", "update",
                           [](Cross& x) { x.output.weights = x.update.data() + 1; }, attend_only},
                      Case{"heads_overlap_queries", "heads", "queries",
                           [](Cross& x) { x.partial.heads = x.queries.data() + 1; }, partial_only},
                      Case{"partial_entropy_null", "entropy", "null",
                           [](Cross& x) { x.partial.entropy = nullptr; }, partial_only}),
    [](const auto& info) { return info.param.name; });

// Outputs sized for Nq rows are enough: the update of a cross call has Q's shape, not X's.
TEST(CrossValidation, OutputsHaveTheQueriesShape) {
  Cross x;
  x.weights.assign(B * H * Nq * N, 0.0);
  std::vector<double> tight(B * Nq * d);
  x.output.update = tight.data();
  EXPECT_NO_THROW(attend(x.input, x.output, {Device::reference}));
  EXPECT_NO_THROW(attend(x.input, x.output, {Device::cpu}));
}

// The new fields at their limits are accepted: positions at +-2^60 minus the rows, a window
// far wider than any distance, self-attention with query_tokens = N.
TEST(CrossValidation, AcceptsTheLimits) {
  Cross x;
  x.input.mask = Mask::sliding_window(std::numeric_limits<std::int64_t>::max());
  x.input.key_position = (std::int64_t{1} << 60) - N;
  x.input.query_position = -(std::int64_t{1} << 60);
  EXPECT_NO_THROW(attend(x.input, x.output, {Device::reference}));
  x.input.queries = nullptr;
  x.input.query_lengths = nullptr;
  x.input.query_tokens = N;
  x.input.key_position = 0;
  x.input.query_position = kAlignToEnd;
  std::vector<double> update(B * N * d), lse(B * H * N), entropy(B * H * N);
  const AttentionOutput<double> out{update.data(), lse.data(), entropy.data(), nullptr};
  EXPECT_NO_THROW(attend(x.input, out, {Device::reference}));
}

TEST(PartialValidation, MergeAndFinishCheckTheirStates) {
  const PartialShape shape{1, 2, 3, 4};
  std::vector<double> a(24), b(24), la(6), lb(6), ha(6), hb(6), update(12);
  const PartialInput<double> part{b.data(), lb.data(), hb.data()};
  const PartialOutput<double> into{a.data(), la.data(), ha.data()};
  EXPECT_NO_THROW(merge_partial(shape, part, into));
  EXPECT_TRUE(throws_error(
      [&] {
        merge_partial(PartialShape{1, 0, 3, 4}, part, into);
      },
      ErrorCode::invalid_argument, {"'heads'", "got 0"}));
  EXPECT_TRUE(throws_error(
      [&] {
        merge_partial(shape, part, PartialOutput<double>{a.data(), nullptr, ha.data()});
      },
      ErrorCode::invalid_argument, {"'into.lse'", "null"}));
  EXPECT_TRUE(throws_error(
      [&] {
        merge_partial(shape, PartialInput<double>{a.data() + 4, lb.data(), hb.data()}, into);
      },
      ErrorCode::invalid_argument, {"'into.heads'", "part.heads"}));
  const PartialInput<double> state{a.data(), la.data(), ha.data()};
  EXPECT_NO_THROW(
      finish_partial<double>(shape, state, nullptr, {update.data(), nullptr, nullptr, nullptr}));
  EXPECT_TRUE(throws_error(
      [&] {
        finish_partial<double>(shape, state, nullptr, {update.data(), nullptr, nullptr, b.data()});
      },
      ErrorCode::invalid_argument, {"'weights'"}));
  EXPECT_TRUE(throws_error(
      [&] {
        finish_partial<double>(shape, state, nullptr, {a.data() + 2, nullptr, nullptr, nullptr});
      },
      ErrorCode::invalid_argument, {"'update'", "state.heads"}));
  EXPECT_TRUE(throws_error(
      [&] {
        finish_partial<double>(shape, state, nullptr, {nullptr, nullptr, nullptr, nullptr});
      },
      ErrorCode::invalid_argument, {"'update'", "null"}));
}

}  // namespace
}  // namespace emflow
