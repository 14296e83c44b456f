// Cross-attention on every backend against the oracle written from the definition
// (attention/cross.hpp): queries Q (B, Nq, d) against keys X (B, N, d) with Nq != N at awkward
// sizes, every mask aligned bottom-right, ragged key and query lengths, explicit and per-cloud
// query positions, self-attention through the new fields, bias, offset, several heads and the
// weights. Every target computes it: an ErrorCode::unsupported fails the test.
//
// Case names: target, then B, H, N (keys), q (queries), d, mask, then ragged (key and query
// lengths), at<P> (explicit query position P, keys at 5), per (a position per cloud), self,
// bias, offset, weights.
#include "attention/cross.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <ostream>
#include <string>
#include <vector>

#include "attention/backends.hpp"
#include "common/testing.hpp"

namespace emflow::testing {
namespace {

enum class Positions { aligned, explicit_position, per_cloud };

struct Case {
  std::int64_t batch, heads, tokens, query_tokens, dim;
  Mask mask;
  bool ragged = false;
  Positions positions = Positions::aligned;
  bool self = false, bias = false, offset = false, weights = false;

  std::int64_t query_position() const { return 5 + tokens / 2 - query_tokens / 2; }

  std::string name() const {
    std::string out = "B" + std::to_string(batch) + "_H" + std::to_string(heads) + "_N" +
                      std::to_string(tokens) + "_q" + std::to_string(query_tokens) + "_d" +
                      std::to_string(dim) + "_" + name_part(to_string(mask));
    if (ragged) out += "_ragged";
    if (positions == Positions::explicit_position) out += "_at" + std::to_string(query_position());
    if (positions == Positions::per_cloud) out += "_per";
    if (self) out += "_self";
    if (bias) out += "_bias";
    if (offset) out += "_offset";
    if (weights) out += "_weights";
    return out;
  }

  CrossProblem problem() const {
    CrossProblem p;
    p.batch = batch;
    p.heads = heads;
    p.tokens = tokens;
    p.query_tokens = self ? tokens : query_tokens;
    p.dim = dim;
    p.mask = mask;
    p.self = self;
    p.bias = bias;
    p.offset = offset;
    p.beta = 0.9;
    for (std::int64_t b = 0; ragged && b < batch; ++b) {
      const std::int64_t keys[] = {tokens - tokens / 3, tokens, 0, tokens / 2};
      const std::int64_t rows = p.query_tokens;
      const std::int64_t queries[] = {rows, std::max<std::int64_t>(1, rows / 2), rows, 0};
      p.key_lengths.push_back(keys[b % 4]);
      p.query_lengths.push_back(queries[b % 4]);
    }
    if (positions != Positions::aligned) {
      p.key_position = 5;
      p.query_position = query_position();
    }
    for (std::int64_t b = 0; positions == Positions::per_cloud && b < batch; ++b) {
      // From before the first key (no key visible under a causal mask) to past the last.
      p.query_positions.push_back(5 - p.query_tokens + b * (tokens + p.query_tokens) / batch);
    }
    p.fill(static_cast<std::uint64_t>(7 * tokens + 3 * query_tokens + dim + batch));
    return p;
  }
};

using Param = OnTarget<Case>;

class CrossMatchesOracle : public ::testing::TestWithParam<Param> {};

template <class T>
void check(const Target& target, const Case& c) {
  const CrossProblem problem = c.problem();
  CrossBuffers<T> got(problem, c.weights);
  run_cross(target, got);
  expect_cross_matches(got, cross_oracle(problem), target.tolerance(),
                       target.name() + " " + c.name());
}

TEST_P(CrossMatchesOracle, AllOutputs) {
  const Param& param = GetParam();
  EMFLOW_REQUIRE_TARGET(param.target);
  in_precision(param.target.is_double,
               [&](auto zero) { check<decltype(zero)>(param.target, param.c); });
}

std::vector<Case> cases() {
  const Mask none = Mask::none(), causal = Mask::causal();
  const Mask w3 = Mask::sliding_window(3), w40 = Mask::sliding_window(40);
  std::vector<Case> out;
  // Every mask at awkward shapes: fewer queries than keys, more, one of each.
  for (const Mask& m : {none, causal, w3, w40}) {
    out.push_back({1, 1, 7, 3, 3, m});
    out.push_back({1, 1, 3, 7, 3, m});
    out.push_back({1, 1, 1, 1, 1, m});
    out.push_back({2, 2, 33, 5, 7, m, true, Positions::aligned, false, true, true, true});
    out.push_back({4, 3, 130, 16, 64, m, true, Positions::aligned, false, true, true});
    out.push_back({3, 2, 70, 33, 3, m, false, Positions::explicit_position, false, true, false});
    out.push_back({4, 2, 45, 9, 5, m, true, Positions::per_cloud, false, false, true, true});
  }
  // Self-attention through the fields: query lengths shorter than the key lengths.
  out.push_back({4, 2, 40, 40, 6, causal, true, Positions::aligned, true, true, true, true});
  out.push_back({2, 1, 40, 40, 6, w3, false, Positions::explicit_position, true});
  // Several key tiles and query blocks; a query block of 16 against a long cloud.
  out.push_back({1, 2, 1000, 16, 64, causal, false, Positions::aligned, false, true, true});
  out.push_back({2, 1, 700, 130, 32, w40, true, Positions::aligned, false, true, true});
  out.push_back({1, 1, 2000, 1, 128, none});
  out.push_back({2, 2, 300, 77, 255, causal, true, Positions::per_cloud, false, true, true});
  // Few queries against enough keys for the CPU engine to split them across threads.
  out.push_back({1, 1, 9000, 1, 8, none, false, Positions::aligned, false, true, true});
  out.push_back({2, 2, 7000, 5, 6, causal, true, Positions::aligned, false, true, true});
  out.push_back({1, 1, 6100, 16, 16, w40, false, Positions::explicit_position});
  out.push_back({3, 1, 5000, 3, 4, causal, true, Positions::per_cloud, false, false, true});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Cross, CrossMatchesOracle, ::testing::ValuesIn(on_every_target(cases())),
                         on_target_name<Case>);

// Queries equal to the last Nq tokens of X, aligned bottom-right, give exactly the last Nq rows
// of causal self-attention: the alignment ties cross-attention to the self-attention reference.
TEST(CrossAlignment, LastRowsOfCausalSelfAttention) {
  CrossProblem self;
  self.batch = 2;
  self.heads = 2;
  self.tokens = 50;
  self.dim = 8;
  self.mask = Mask::causal();
  self.self = true;
  self.bias = self.offset = true;
  self.fill(11);
  CrossProblem cross = self;
  cross.self = false;
  cross.query_tokens = 9;
  for (std::int64_t b = 0; b < 2; ++b) {
    const auto first = self.cloud.begin() + (b * 50 + 41) * 8;
    cross.queries.insert(cross.queries.end(), first, first + 9 * 8);
  }
  CrossBuffers<double> whole(self, false), tail(cross, false);
  whole.input.queries = nullptr;
  whole.input.query_tokens = 0;
  attend(whole.input, whole.output, {Device::reference});
  for (Device device : {Device::reference, Device::cpu}) {
    tail.poison();
    attend(tail.input, tail.output, {device, 2});
    for (std::int64_t b = 0; b < 2; ++b) {
      for (std::int64_t k = 0; k < 9 * 8; ++k) {
        EXPECT_NEAR(tail.update[b * 72 + k], whole.update[(b * 50 + 41) * 8 + k], 1e-12);
      }
      for (std::int64_t h = 0; h < 2; ++h) {
        for (std::int64_t i = 0; i < 9; ++i) {
          EXPECT_NEAR(tail.lse[(b * 2 + h) * 9 + i], whole.lse[(b * 2 + h) * 50 + 41 + i], 1e-12);
          EXPECT_NEAR(tail.entropy[(b * 2 + h) * 9 + i], whole.entropy[(b * 2 + h) * 50 + 41 + i],
                      1e-12);
        }
      }
    }
  }
}

// The CPU engine's split of the keys follows from the shape, not the thread count: one, two and
// three threads give the same bits.
TEST(CrossSplit, ResultsDoNotDependOnTheThreadCount) {
  Case c{2, 2, 20000, 9, 16, Mask::causal(), true, Positions::aligned, false, true, true};
  const CrossProblem problem = c.problem();
  std::vector<CrossBuffers<float>> runs;
  for (int threads : {1, 2, 3}) {
    runs.emplace_back(problem, false);
    attend(runs.back().input, runs.back().output, {Device::cpu, threads});
  }
  for (std::size_t k = 1; k < runs.size(); ++k) {
    EXPECT_EQ(runs[k].update, runs[0].update);
    EXPECT_EQ(runs[k].lse, runs[0].lse);
    EXPECT_EQ(runs[k].entropy, runs[0].entropy);
  }
  EXPECT_TRUE(close_to(runs[0].update, cross_oracle(problem).update, 1e-5));
}

}  // namespace
}  // namespace emflow::testing
