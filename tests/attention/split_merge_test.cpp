// Partial states over blocks of keys and their exact merge (include/emflow/partial.hpp), on every
// backend that computes them: the keys of each cloud are cut at random places into 1..8 blocks,
// each block's state comes from attend_partial (keys at their true positions, queries at the
// whole call's origin per cloud), the states are merged in a random order by merge_partial and
// finished by finish_partial, and update, lse and entropy must equal the one-pass attend on the
// same backend to 1e-6 (float) or 1e-12 (double). A block no query sees changes nothing, bit for
// bit. Outputs and states are poisoned with NaN before every call.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "attention/backends.hpp"
#include "attention/cross.hpp"
#include "common/testing.hpp"
#include "emflow/partial.hpp"

namespace emflow::testing {
namespace {

// A case's problem is made when its test runs, not when the cases are registered: every process
// of the suite registers all of them, and filling the large ones there cost each process a
// quarter of a second.
struct Case {
  std::string name;
  std::function<CrossProblem()> problem;
};

CrossProblem make(std::int64_t B, std::int64_t H, std::int64_t N, std::int64_t Nq, std::int64_t d,
                  Mask mask, bool ragged, bool self = false) {
  CrossProblem p;
  p.batch = B;
  p.heads = H;
  p.tokens = N;
  p.query_tokens = self ? N : Nq;
  p.dim = d;
  p.mask = mask;
  p.self = self;
  p.bias = p.offset = true;
  p.beta = 1.1;
  for (std::int64_t b = 0; ragged && b < B; ++b) {
    const std::int64_t keys[] = {N, N - N / 3, 0, N / 2};
    const std::int64_t rows = p.query_tokens;
    p.key_lengths.push_back(keys[b % 4]);
    p.query_lengths.push_back(b % 4 == 1 ? std::max<std::int64_t>(1, rows / 2) : rows);
  }
  p.fill(static_cast<std::uint64_t>(N * 13 + Nq + d));
  return p;
}

std::vector<Case> cases() {
  const Mask none = Mask::none(), causal = Mask::causal(), w = Mask::sliding_window(37);
  return {
      {"B1_H1_N1_q1_d1_none", [=] { return make(1, 1, 1, 1, 1, none, false); }},
      {"B2_H2_N65_q16_d7_causal", [=] { return make(2, 2, 65, 16, 7, causal, false); }},
      {"B4_H2_N300_q16_d64_causal_ragged", [=] { return make(4, 2, 300, 16, 64, causal, true); }},
      {"B4_H3_N130_q33_d5_window37_ragged", [=] { return make(4, 3, 130, 33, 5, w, true); }},
      {"B3_H1_N200_q1_d32_none_ragged", [=] { return make(3, 1, 200, 1, 32, none, true); }},
      {"B2_H2_N90_q90_d6_causal_self", [=] { return make(2, 2, 90, 90, 6, causal, false, true); }},
      {"B1_H2_N1000_q16_d64_window37", [=] { return make(1, 2, 1000, 16, 64, w, false); }},
      {"B2_H1_N9000_q3_d8_causal_ragged", [=] { return make(2, 1, 9000, 3, 8, causal, true); }},
  };
}

struct Param {
  Target target;
  Case c;
  int seed;
};

template <class T>
struct State {
  std::vector<T> heads, lse, entropy;
  explicit State(const PartialShape& s)
      : heads(static_cast<std::size_t>(s.batch * s.heads * s.query_tokens * s.dim),
              std::numeric_limits<T>::quiet_NaN()),
        lse(static_cast<std::size_t>(s.batch * s.heads * s.query_tokens), heads[0]),
        entropy(lse.size(), heads[0]) {}
  PartialOutput<T> out() { return {heads.data(), lse.data(), entropy.data()}; }
  PartialInput<T> in() const { return {heads.data(), lse.data(), entropy.data()}; }
};

/// The keys [first, last) of every cloud of `p` as a problem of their own, at their positions.
CrossProblem block_of(const CrossProblem& p, std::int64_t first, std::int64_t last) {
  CrossProblem block = p;
  block.tokens = last - first;
  block.cloud.clear();
  block.key_lengths.clear();
  for (std::int64_t b = 0; b < p.batch; ++b) {
    const auto row = p.cloud.begin() + (b * p.tokens + first) * p.dim;
    block.cloud.insert(block.cloud.end(), row, row + (last - first) * p.dim);
    block.key_lengths.push_back(std::clamp<std::int64_t>(p.key_length(b) - first, 0, last - first));
    block.query_positions.push_back(p.query_origin(b));
  }
  if (p.self) {  // the queries stay the whole cloud's tokens
    block.self = false;
    block.queries = p.cloud;
    block.query_tokens = p.tokens;
    if (block.query_lengths.empty()) {
      for (std::int64_t b = 0; b < p.batch; ++b) block.query_lengths.push_back(p.query_length(b));
    }
  }
  block.key_position = p.key_position + first;
  return block;
}

Device device_of(const Target& t) {
  return t.backend == Backend::reference ? Device::reference
         : t.backend == Backend::cpu     ? Device::cpu
                                         : Device::cuda;
}

template <class T>
void check(const Target& target, const CrossProblem& p, int seed) {
  CrossBuffers<T> whole(p, false);
  run_cross(target, whole);
  const PartialShape shape{p.batch, p.heads, p.rows(), p.dim};
  const ExecutionOptions options{device_of(target), target.threads};

  std::mt19937 random(static_cast<unsigned>(seed));
  const int blocks = 1 + static_cast<int>(random() % 8);
  std::vector<std::int64_t> cuts{0, p.tokens};
  for (int k = 1; k < blocks; ++k)
    cuts.push_back(static_cast<std::int64_t>(random() % (p.tokens + 1)));
  std::sort(cuts.begin(), cuts.end());
  cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  std::vector<std::size_t> order(cuts.size() - 1);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), random);

  State<T> merged(shape);
  bool first = true;
  for (std::size_t k : order) {
    CrossBuffers<T> block(block_of(p, cuts[k], cuts[k + 1]), false);
    State<T> part(shape);
    attend_partial(block.input, part.out(), options);
    if (first) {
      merged = part;
      first = false;
    } else {
      merge_partial(shape, part.in(), merged.out());
    }
  }
  CrossBuffers<T> got(p, false);
  finish_partial(shape, merged.in(), got.input.layer.offset, got.output);
  const double tolerance = target.is_double ? 1e-12 : 1e-6;
  const std::vector<double> update(whole.update.begin(), whole.update.end());
  const std::vector<double> lse(whole.lse.begin(), whole.lse.end());
  const std::vector<double> entropy(whole.entropy.begin(), whole.entropy.end());
  EXPECT_TRUE(close_to(got.update, update, tolerance)) << cuts.size() - 1 << " blocks";
  EXPECT_TRUE(close_to(got.lse, lse, tolerance)) << cuts.size() - 1 << " blocks";
  EXPECT_TRUE(close_to(got.entropy, entropy, tolerance)) << cuts.size() - 1 << " blocks";
  for (std::size_t r = 0; r < lse.size(); ++r) {
    if (lse[r] == -std::numeric_limits<double>::infinity()) {
      EXPECT_EQ(got.lse[r], -std::numeric_limits<T>::infinity()) << "row " << r;
      EXPECT_EQ(got.entropy[r], T(0)) << "row " << r;
    }
  }

  // A block of keys that no query sees (past every key length) leaves the state as it is.
  CrossProblem hidden = block_of(p, 0, std::min<std::int64_t>(p.tokens, 4));
  hidden.key_lengths.assign(static_cast<std::size_t>(p.batch), 0);
  CrossBuffers<T> nothing(hidden, false);
  State<T> empty(shape);
  attend_partial(nothing.input, empty.out(), options);
  State<T> after = merged;
  merge_partial(shape, empty.in(), after.out());
  EXPECT_EQ(0,
            std::memcmp(after.heads.data(), merged.heads.data(), after.heads.size() * sizeof(T)));
  EXPECT_EQ(0, std::memcmp(after.lse.data(), merged.lse.data(), after.lse.size() * sizeof(T)));
  EXPECT_EQ(0, std::memcmp(after.entropy.data(), merged.entropy.data(),
                           after.entropy.size() * sizeof(T)));
}

class SplitAndMerge : public ::testing::TestWithParam<Param> {};

TEST_P(SplitAndMerge, EqualsOnePass) {
  const Param& param = GetParam();
  EMFLOW_REQUIRE_TARGET(param.target);
  if (param.target.is_double) {
    check<double>(param.target, param.c.problem(), param.seed);
  } else {
    check<float>(param.target, param.c.problem(), param.seed);
  }
}

std::vector<Param> params() {
  std::vector<Param> out;
  for (const Target& t : all_targets()) {
    // The blocking attend_partial runs on reference, cpu and cuda; the stream-ordered
    // attend_partial_async is the test matrix's (matrix_test.cpp), with an algorithm of its own.
    if (t.backend == Backend::cuda_fused || t.backend == Backend::cuda_unfused) continue;
    for (const Case& c : cases()) {
      for (int seed = 1; seed <= 3; ++seed) out.push_back({t, c, seed});
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Blocks, SplitAndMerge, ::testing::ValuesIn(params()),
                         [](const ::testing::TestParamInfo<Param>& info) {
                           return info.param.target.name() + "_" + info.param.c.name + "_seed" +
                                  std::to_string(info.param.seed);
                         });

}  // namespace
}  // namespace emflow::testing
