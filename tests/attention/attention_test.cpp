// Every attention backend (reference, cpu, cuda blocking, cuda fused and unfused through
// attend_async) held against the composed double-precision reference (reference::attend) on
// awkward sizes, every mask, key lengths (with empty and full clouds), key bias, offset, several
// heads and clouds, with lse, entropy and weights where the backend returns them.
//
// A case's name says it all: cuda_fused_f32_B2_H3_N33_d7_causal_mixed_bias_offset is the target,
// then batch, heads, tokens, dim and mask, then what is given (full or mixed key lengths, key bias
// u, offset c, beta 0p7 = 0.7) and asked (weights; nostats: neither lse nor entropy). The suites
// are Small (a few of every kind, cheap enough for the CUDA emulation), Sweep (every size against
// every mask) and Large (several key tiles and query blocks per cloud).
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <ostream>
#include <string>
#include <vector>

#include "attention/backends.hpp"
#include "attention/checks.hpp"
#include "common/testing.hpp"

namespace emflow::testing {
namespace {

/// Key lengths of a case: none given, every cloud full (L = N), or cloud b % 3 == 0 partial,
/// 1 full, 2 empty (L = 0: every query is padding).
enum class Lengths { none, full, mixed };

struct Case {
  std::int64_t batch, heads, tokens, dim;
  Mask mask;
  Lengths lengths = Lengths::none;
  bool bias = false, offset = false;
  double beta = 1.0;
  bool weights = false;
  bool stats = true;  // lse and entropy requested

  std::string name() const {
    std::string out = shape_name(batch, heads, tokens, dim, mask);
    if (lengths == Lengths::full) out += "_full";
    if (lengths == Lengths::mixed) out += "_mixed";
    if (bias) out += "_bias";
    if (offset) out += "_offset";
    if (beta != 1.0) {  // "_beta0p7"
      std::string b = std::to_string(beta);
      b.erase(b.find_last_not_of('0') + 1);
      if (b.back() == '.') b.pop_back();
      for (char& ch : b) ch = ch == '.' ? 'p' : ch;
      out += "_beta" + b;
    }
    if (weights) out += "_weights";
    if (!stats) out += "_nostats";
    return out;
  }

  Problem problem() const {
    Problem p = Problem::random(batch, tokens, dim, heads, 1000 + tokens * 7 + dim + batch);
    p.mask = mask;
    p.key_bias = bias;
    p.offset = offset;
    p.beta = beta;
    for (std::int64_t b = 0; lengths != Lengths::none && b < batch; ++b) {
      const std::int64_t kind = lengths == Lengths::full ? 1 : b % 3;
      p.key_lengths.push_back(kind == 0   ? std::max<std::int64_t>(1, tokens - tokens / 3)
                              : kind == 1 ? tokens
                                          : 0);
    }
    return p;
  }
};

using Param = OnTarget<Case>;

/// The composed reference of a case, computed once for all targets.
const reference::Attention& expected_for(const Case& c) {
  static std::map<std::string, reference::Attention> cache;
  const std::string key = c.name();
  auto found = cache.find(key);
  if (found == cache.end()) {
    found = cache.emplace(key, composed_reference(c.problem(), c.weights)).first;
  }
  return found->second;
}

class AttentionMatchesReference : public ::testing::TestWithParam<Param> {};

template <class T>
void check(const Target& target, const Case& c) {
  Buffers<T> got(c.problem(), c.weights, c.stats);
  run_on(target, got);
  expect_matches(got, expected_for(c), target.tolerance(), target.name() + " " + c.name());
}

TEST_P(AttentionMatchesReference, AllOutputs) {
  const Param& param = GetParam();
  EMFLOW_REQUIRE_TARGET(param.target);
  in_precision(param.target.is_double,
               [&](auto zero) { check<decltype(zero)>(param.target, param.c); });
}

constexpr Mask kNone = Mask::none();
constexpr Mask kCausal = Mask::causal();
Mask window(std::int64_t w) { return Mask::sliding_window(w); }

// A few of every kind: one token, d = 1, every mask, key lengths with an empty and a full
// cloud, bias and offset, several heads and clouds, weights, no statistics, beta != 1.
std::vector<Case> small_cases() {
  return {
      {1, 1, 1, 1, kNone},
      {1, 1, 1, 1, kNone, Lengths::none, false, false, 1.0, true},
      {2, 2, 7, 3, kCausal, Lengths::none, true, true},
      {2, 2, 7, 3, kCausal, Lengths::mixed, true, true, 1.0, true},
      {2, 2, 7, 3, window(2), Lengths::none, true, true, 1.0, true},
      {3, 3, 33, 64, window(5), Lengths::mixed, true, true, 0.7},
      {3, 3, 33, 64, kCausal, Lengths::mixed, false, true, 1.0, true},
      {2, 3, 33, 7, kNone, Lengths::full, true, false, 2.0, false, false},
      {3, 2, 101, 1, kNone, Lengths::mixed, false, true},
      {3, 2, 101, 128, kCausal, Lengths::mixed, true, true},
  };
}

// Every size against every mask, and layers of several heads over ragged batches.
std::vector<Case> sweep_cases() {
  std::vector<Case> cases;
  for (std::int64_t n : {1, 2, 7, 33, 101}) {
    for (std::int64_t d : {1, 3, 64}) {
      for (const Mask& m : {kNone, kCausal, window(5)}) cases.push_back({1, 1, n, d, m});
    }
  }
  for (std::int64_t d : {100, 128, 255}) {
    for (std::int64_t n : {7, 101}) {
      cases.push_back({1, 1, n, d, kNone});
      cases.push_back({1, 2, n, d, kCausal, Lengths::none, true, true});
    }
  }
  for (const Mask& m : {kNone, kCausal, window(17)}) {
    cases.push_back({3, 3, 101, 33, m, Lengths::mixed, true, true});
    cases.push_back({2, 4, 70, 16, m, Lengths::full, false, true, 0.5});
  }
  cases.push_back({4, 2, 33, 64, kNone, Lengths::mixed, true, false, 2.0});
  cases.push_back({2, 3, 1, 3, kNone, Lengths::mixed, true, true});
  cases.push_back({1, 4, 33, 255, kCausal, Lengths::none, true, false});
  cases.push_back({2, 3, 65, 32, kNone, Lengths::none, false, false, 1.0, false, false});
  for (const Mask& m : {kNone, kCausal, window(9)}) {
    cases.push_back({2, 2, 45, 7, m, Lengths::mixed, true, false, 1.0, true});
  }
  cases.push_back({3, 2, 101, 64, kCausal, Lengths::mixed, true, true, 1.0, true});
  cases.push_back({3, 2, 101, 128, window(17), Lengths::mixed, true, true, 0.7});
  cases.push_back({3, 2, 257, 64, kCausal, Lengths::mixed, true, true});
  cases.push_back({3, 2, 257, 64, kCausal, Lengths::mixed, true, true, 1.0, true});
  return cases;
}

// Several key tiles and query blocks per cloud, windows narrower and wider than a tile.
std::vector<Case> large_cases() {
  return {
      {2, 2, 200, 16, window(5), Lengths::mixed, true, true},
      {1, 1, 300, 130, window(70), Lengths::none, true, true},
      {3, 2, 300, 64, window(1), Lengths::mixed, true, true},
      {1, 1, 1000, 64, kNone},
      {1, 1, 1000, 128, kCausal, Lengths::none, true, false},
      {1, 1, 1000, 255, window(300), Lengths::none, false, true},
      {1, 1, 1000, 255, kNone, Lengths::none, true, true},
      {1, 1, 1000, 255, kNone, Lengths::none, true, true, 1.0, true},
      {2, 2, 1000, 128, window(300), Lengths::mixed, true, true, 1.3},
      {1, 1, 1000, 64, window(1), Lengths::none, false, true},
      {1, 1, 1000, 3, window(50), Lengths::none, true, true},
      {1, 1, 4097, 3, kCausal},
      {1, 1, 4097, 64, kCausal, Lengths::none, true, true},
      {1, 1, 4097, 3, window(1000), Lengths::none, true, true},
  };
}

INSTANTIATE_TEST_SUITE_P(Small, AttentionMatchesReference,
                         ::testing::ValuesIn(on_every_target(small_cases())), on_target_name<Case>);
INSTANTIATE_TEST_SUITE_P(Sweep, AttentionMatchesReference,
                         ::testing::ValuesIn(on_every_target(sweep_cases())), on_target_name<Case>);
INSTANTIATE_TEST_SUITE_P(Large, AttentionMatchesReference,
                         ::testing::ValuesIn(on_every_target(large_cases())), on_target_name<Case>);

}  // namespace
}  // namespace emflow::testing
