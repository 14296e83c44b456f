// Partial states of the factored form with rotary positions and grouped kv heads (partial.hpp,
// docs/MATH.md §1.6, §2.4): the keys of each cloud cut into 1..3 blocks, each block's state from
// attend_partial (its keys at their true positions through key_position, or through
// rotary.key_positions, the queries at the whole call's position), merged by merge_partial and
// finished by finish_partial, equal the one call of attend_factored (float 1e-6, double 1e-12
// relative) for both pairings, a rotary dimension below the rank, grouped heads, masks, key
// lengths, self-attention and queries of their own; the routes and the refusals by name.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "common/testing.hpp"
#include "emflow/attention.hpp"
#include "emflow/capability.hpp"
#include "emflow/factored.hpp"
#include "emflow/partial.hpp"

namespace emflow {
namespace {

using testing::close_to;

struct Split {
  std::int64_t batch = 2, tokens = 23, query_tokens = 5, dim = 8, heads = 6, kv_heads = 3;
  std::int64_t rank = 6, query_position = 19;
  bool self = false, lengths = false, explicit_positions = false;
  double beta = 0.9;
  Mask mask = Mask::causal();
  Rotary rotary;
  std::vector<double> cloud, queries, A, B, U, V, u, c;
  std::vector<std::int64_t> key_lengths, key_positions;

  std::int64_t Nq() const { return self ? tokens : query_tokens; }
  std::int64_t origin() const { return self ? 0 : query_position; }

  void fill(std::uint64_t seed) {
    const auto n = [](std::int64_t x) { return static_cast<std::size_t>(x); };
    const double s = 1.4 / std::sqrt(static_cast<double>(dim));
    cloud = testing::uniform(n(batch * tokens * dim), seed);
    queries = self ? cloud : testing::uniform(n(batch * query_tokens * dim), seed + 1);
    A = testing::uniform(n(heads * rank * dim), seed + 2, -s, s);
    B = testing::uniform(n(kv_heads * rank * dim), seed + 3, -s, s);
    U = testing::uniform(n(heads * dim * rank), seed + 4, -s, s);
    V = testing::uniform(n(kv_heads * rank * dim), seed + 5, -s, s);
    u = testing::uniform(n(heads * dim), seed + 6, -0.5, 0.5);
    c = testing::uniform(n(dim), seed + 7);
    key_lengths.clear();
    for (std::int64_t b = 0; lengths && b < batch; ++b) key_lengths.push_back(tokens - 5 * b);
    key_positions.clear();
    // Explicit rotary positions: every key 40 further on, as a model's position_ids may say.
    for (std::int64_t b = 0; explicit_positions && b < batch; ++b) {
      for (std::int64_t j = 0; j < tokens; ++j) key_positions.push_back(40 + j);
    }
  }
};

template <class T>
std::vector<T> as(const std::vector<double>& v) {
  return std::vector<T>(v.begin(), v.end());
}

template <class T>
struct Layer {
  std::vector<T> A, B, U, V, u, c;
  FactoredLayer<T> layer;
  explicit Layer(const Split& p)
      : A(as<T>(p.A)), B(as<T>(p.B)), U(as<T>(p.U)), V(as<T>(p.V)), u(as<T>(p.u)), c(as<T>(p.c)) {
    layer = {p.heads,  p.rank,   A.data(), B.data(),   U.data(),
             V.data(), u.data(), c.data(), p.kv_heads, p.rotary};
  }
};

template <class T>
struct Rows {
  std::vector<T> update;
  std::vector<Stat<T>> lse, entropy;
};

/// The one call of attend_factored over all the keys.
template <class T>
Rows<T> one_call(const Split& p, Device device) {
  const Layer<T> f(p);
  FactoredLayer<T> layer = f.layer;
  std::vector<std::int64_t> query_positions;
  if (p.explicit_positions) {
    layer.rotary.key_positions = p.key_positions.data();
    // The queries 40 further on too.
    for (std::int64_t b = 0; b < p.batch; ++b) {
      for (std::int64_t i = 0; i < p.Nq(); ++i) query_positions.push_back(40 + p.origin() + i);
    }
    layer.rotary.query_positions = query_positions.data();
  }
  const std::vector<T> cloud = as<T>(p.cloud), queries = as<T>(p.queries);
  const auto rows = static_cast<std::size_t>(p.batch * p.heads * p.Nq());
  Rows<T> out{std::vector<T>(static_cast<std::size_t>(p.batch * p.Nq() * p.dim), T(NAN)),
              std::vector<Stat<T>>(rows, Stat<T>(NAN)), std::vector<Stat<T>>(rows, Stat<T>(NAN))};
  AttentionInput<T> in;
  in.cloud = cloud.data();
  in.batch = p.batch;
  in.tokens = p.tokens;
  in.dim = p.dim;
  in.beta = p.beta;
  in.mask = p.mask;
  in.key_lengths = p.lengths ? p.key_lengths.data() : nullptr;
  if (!p.self) {
    in.queries = queries.data();
    in.query_tokens = p.query_tokens;
    in.query_position = p.query_position;
  }
  attend_factored(in, layer, {out.update.data(), out.lse.data(), out.entropy.data(), nullptr},
                  {device, 2});
  return out;
}

/// The keys cut at `cuts` into blocks, each block's partial state, merged in order and finished.
template <class T>
Rows<T> split_and_merge(const Split& p, const std::vector<std::int64_t>& cuts, Device device) {
  const Layer<T> f(p);
  const std::int64_t B = p.batch, N = p.tokens, Nq = p.Nq(), d = p.dim, H = p.heads;
  const std::vector<T> queries = as<T>(p.queries);
  const auto rows = static_cast<std::size_t>(B * H * Nq);
  const PartialShape shape{B, H, Nq, d};
  std::vector<T> heads(rows * static_cast<std::size_t>(d)), part_heads(heads.size());
  std::vector<Stat<T>> lse(rows), entropy(rows), part_lse(rows), part_entropy(rows);
  std::vector<std::int64_t> query_positions;
  for (std::int64_t b = 0; p.explicit_positions && b < B; ++b) {
    for (std::int64_t i = 0; i < Nq; ++i) query_positions.push_back(40 + p.origin() + i);
  }
  std::vector<std::int64_t> bounds{0};
  bounds.insert(bounds.end(), cuts.begin(), cuts.end());
  bounds.push_back(N);
  for (std::size_t k = 0; k + 1 < bounds.size(); ++k) {
    const std::int64_t first = bounds[k], n = bounds[k + 1] - first;
    // The block's keys of every cloud, its key lengths and rotary positions.
    std::vector<T> keys;
    std::vector<std::int64_t> lengths, positions;
    for (std::int64_t b = 0; b < B; ++b) {
      const auto at = p.cloud.begin() + (b * N + first) * d;
      keys.insert(keys.end(), at, at + n * d);
      if (p.lengths) {
        lengths.push_back(std::clamp<std::int64_t>(p.key_lengths[b] - first, 0, n));
      }
      if (p.explicit_positions) {
        const auto from = p.key_positions.begin() + b * N + first;
        positions.insert(positions.end(), from, from + n);
      }
    }
    AttentionInput<T> in;
    in.cloud = keys.data();
    in.batch = B;
    in.tokens = n;
    in.dim = d;
    in.beta = p.beta;
    in.mask = p.mask;
    in.key_lengths = p.lengths ? lengths.data() : nullptr;
    in.key_position = first;  // where the block's keys sit
    in.queries = queries.data();
    in.query_tokens = Nq;
    in.query_position = p.origin();
    FactoredLayer<T> layer = f.layer;
    if (p.explicit_positions) {
      layer.rotary.key_positions = positions.data();
      layer.rotary.query_positions = query_positions.data();
    }
    const bool into = k == 0;
    std::vector<T>& h = into ? heads : part_heads;
    std::vector<Stat<T>>& l = into ? lse : part_lse;
    std::vector<Stat<T>>& e = into ? entropy : part_entropy;
    std::fill(h.begin(), h.end(), T(NAN));
    std::fill(l.begin(), l.end(), Stat<T>(NAN));
    std::fill(e.begin(), e.end(), Stat<T>(NAN));
    attend_partial(in, layer, PartialOutput<T>{h.data(), l.data(), e.data()}, {device, 2});
    if (!into) {
      merge_partial(shape, PartialInput<T>{part_heads.data(), part_lse.data(), part_entropy.data()},
                    PartialOutput<T>{heads.data(), lse.data(), entropy.data()});
    }
  }
  Rows<T> out{std::vector<T>(static_cast<std::size_t>(B * Nq * d), T(NAN)),
              std::vector<Stat<T>>(rows, Stat<T>(NAN)), std::vector<Stat<T>>(rows, Stat<T>(NAN))};
  finish_partial(shape, PartialInput<T>{heads.data(), lse.data(), entropy.data()}, f.c.data(),
                 {out.update.data(), out.lse.data(), out.entropy.data(), nullptr});
  return out;
}

template <class T>
void expect_rows(const Rows<T>& got, const Rows<T>& want, double tolerance) {
  EXPECT_TRUE(close_to(got.update, want.update, tolerance)) << "update";
  EXPECT_TRUE(close_to(got.lse, want.lse, tolerance)) << "lse";
  EXPECT_TRUE(close_to(got.entropy, want.entropy, tolerance)) << "entropy";
}

struct Case {
  const char* name;
  std::int64_t kv_heads, rot;
  RotaryPairing pairing;
  Mask mask;
  bool self, lengths, explicit_positions;
};

template <class T>
class PartialRotary : public ::testing::Test {};
using Types = ::testing::Types<float, double>;
TYPED_TEST_SUITE(PartialRotary, Types);

TYPED_TEST(PartialRotary, BlocksMergedEqualTheOneCall) {
  using T = TypeParam;
  const double tolerance = std::is_same_v<T, float> ? 1e-6 : 1e-12;
  const RotaryPairing half = RotaryPairing::half_split, pairs = RotaryPairing::interleaved;
  const Case cases[] = {
      {"cross_causal_grouped", 3, 6, half, Mask::causal(), false, false, false},
      {"cross_none_multiquery", 1, 6, half, Mask::none(), false, false, false},
      {"cross_window_interleaved_dim4", 2, 4, pairs, Mask::sliding_window(6), false, false, false},
      {"cross_causal_lengths", 3, 6, half, Mask::causal(), false, true, false},
      {"self_causal", 3, 6, half, Mask::causal(), true, false, false},
      {"self_window_all_heads", 6, 2, pairs, Mask::sliding_window(4), true, false, false},
      {"self_causal_explicit_positions", 2, 6, half, Mask::causal(), true, false, true},
      {"cross_grouped_no_rotary", 3, 0, half, Mask::causal(), false, false, false},
  };
  for (const Case& c : cases) {
    Split p;
    p.kv_heads = c.kv_heads;
    p.rotary.dim = c.rot;
    p.rotary.base = 25.0;
    p.rotary.pairing = c.pairing;
    p.mask = c.mask;
    p.self = c.self;
    p.lengths = c.lengths;
    p.explicit_positions = c.explicit_positions;
    p.fill(700 + static_cast<std::uint64_t>(c.kv_heads * 10 + c.rot));
    const Rows<T> want = one_call<T>(p, Device::cpu);
    for (const Device device : {Device::cpu, Device::reference, Device::automatic}) {
      for (const std::vector<std::int64_t>& cuts :
           {std::vector<std::int64_t>{}, std::vector<std::int64_t>{11},
            std::vector<std::int64_t>{4, 15}, std::vector<std::int64_t>{1, 22}}) {
        SCOPED_TRACE(std::string(c.name) + " on " + to_string(device) + ", " +
                     std::to_string(cuts.size() + 1) + " blocks");
        expect_rows(split_and_merge<T>(p, cuts, device), want, tolerance);
      }
    }
  }
}

// The positions are read: the blocks of a rotary layer given without their key_position (every
// block at 0) no longer give the one call.
TYPED_TEST(PartialRotary, BlocksMustSitAtTheirPositions) {
  using T = TypeParam;
  Split p;
  p.rotary.dim = 6;
  p.rotary.base = 25.0;
  p.mask = Mask::none();  // the mask ignores the positions: only the rotation reads them
  p.fill(71);
  const Rows<T> want = one_call<T>(p, Device::cpu);
  const Layer<T> f(p);
  const std::vector<T> queries = as<T>(p.queries), cloud = as<T>(p.cloud);
  const std::int64_t B = p.batch, N = p.tokens, Nq = p.Nq(), d = p.dim, H = p.heads;
  const auto rows = static_cast<std::size_t>(B * H * Nq);
  std::vector<T> heads(rows * static_cast<std::size_t>(d));
  std::vector<Stat<T>> lse(rows), entropy(rows);
  AttentionInput<T> in;
  in.cloud = cloud.data();
  in.batch = B;
  in.tokens = N;
  in.dim = d;
  in.beta = p.beta;
  in.queries = queries.data();
  in.query_tokens = Nq;
  in.query_position = p.query_position + 3;  // the queries elsewhere
  attend_partial(in, f.layer, PartialOutput<T>{heads.data(), lse.data(), entropy.data()});
  Rows<T> got{std::vector<T>(static_cast<std::size_t>(B * Nq * d)), std::vector<Stat<T>>(rows),
              std::vector<Stat<T>>(rows)};
  finish_partial(PartialShape{B, H, Nq, d},
                 PartialInput<T>{heads.data(), lse.data(), entropy.data()}, f.c.data(),
                 {got.update.data(), got.lse.data(), got.entropy.data(), nullptr});
  EXPECT_GT(testing::relative_error(got.update, want.update), 1e-3);
  // At the right position it is the one call.
  in.query_position = p.query_position;
  attend_partial(in, f.layer, PartialOutput<T>{heads.data(), lse.data(), entropy.data()});
  finish_partial(PartialShape{B, H, Nq, d},
                 PartialInput<T>{heads.data(), lse.data(), entropy.data()}, f.c.data(),
                 {got.update.data(), got.lse.data(), got.entropy.data(), nullptr});
  expect_rows(got, want, std::is_same_v<T, float> ? 1e-6 : 1e-12);
}

TYPED_TEST(PartialRotary, RoutesAndRefusals) {
  using T = TypeParam;
  Split p;
  p.rotary.dim = 6;
  p.fill(72);
  const Layer<T> f(p);
  const std::vector<T> queries = as<T>(p.queries), cloud = as<T>(p.cloud);
  const auto rows = static_cast<std::size_t>(p.batch * p.heads * p.Nq());
  std::vector<T> heads(rows * static_cast<std::size_t>(p.dim));
  std::vector<Stat<T>> lse(rows), entropy(rows);
  AttentionInput<T> in;
  in.cloud = cloud.data();
  in.batch = p.batch;
  in.tokens = p.tokens;
  in.dim = p.dim;
  in.queries = queries.data();
  in.query_tokens = p.query_tokens;
  in.query_position = p.query_position;
  const PartialOutput<T> out{heads.data(), lse.data(), entropy.data()};

  emflow::Problem problem = describe(in, f.layer, out);
  EXPECT_EQ(problem.operation, Operation::partial);
  EXPECT_EQ(problem.form, Form::factored);
  EXPECT_EQ(problem.kv_heads, 3);
  EXPECT_EQ(problem.rotary_dim, 6);
  EXPECT_FALSE(problem.offset);  // belongs to finish_partial
  Machine gpu;
  gpu.cuda_built = gpu.cuda_device = true;
  for (const Device device : {Device::cpu, Device::reference, Device::automatic}) {
    const Route r = route(problem, device, gpu, "attend_partial");
    EXPECT_TRUE(r.supported) << r.reason;
    EXPECT_NE(r.device, Device::cuda);
    EXPECT_EQ(r.kernel, Kernel::reference);
    EXPECT_EQ(r.computes, Dtype::float64);
    EXPECT_FALSE(r.expanded);
  }
  const Route refused = route(problem, Device::cuda, gpu, "attend_partial");
  EXPECT_FALSE(refused.supported);
  EXPECT_NE(refused.reason.find("rotary positions (rotary.dim 6)"), std::string::npos)
      << refused.reason;
  EXPECT_NE(refused.reason.find("grouped kv heads (kv_heads 3 of 6)"), std::string::npos)
      << refused.reason;
  problem.rotary_dim = 0;
  problem.kv_heads = problem.heads;  // the position-free factored layer: still host only
  const Route plain = route(problem, Device::cuda, gpu, "attend_partial");
  EXPECT_FALSE(plain.supported);
  EXPECT_NE(plain.reason.find("computed on the host"), std::string::npos) << plain.reason;
  EXPECT_TRUE(testing::throws_error([&] { attend_partial(in, f.layer, out, {Device::cuda}); },
                                    ErrorCode::unsupported, {"attend_partial"}));

  // Argument checks by name: the state's arrays, the operators of input.layer, the grouping.
  EXPECT_TRUE(testing::throws_error(
      [&] {
        attend_partial(in, f.layer, PartialOutput<T>{heads.data(), lse.data(), nullptr});
      },
      ErrorCode::invalid_argument, {"'entropy'"}));
  FactoredLayer<T> bad = f.layer;
  bad.kv_heads = 4;
  EXPECT_TRUE(testing::throws_error([&] { attend_partial(in, bad, out); },
                                    ErrorCode::invalid_argument, {"'kv_heads'", "got 4"}));
  AttentionInput<T> with_dense = in;
  with_dense.layer.relevance = f.A.data();
  EXPECT_TRUE(testing::throws_error([&] { attend_partial(with_dense, f.layer, out); },
                                    ErrorCode::invalid_argument, {"'input.layer'"}));
  // A state that overlaps the queries is refused.
  EXPECT_TRUE(testing::throws_error(
      [&] {
        attend_partial(
            in, f.layer,
            PartialOutput<T>{const_cast<T*>(queries.data()), lse.data(), entropy.data()});
      },
      ErrorCode::invalid_argument, {"'heads'", "shares memory"}));
  // The dynamic scaling's frequencies follow the whole sequence, which a block does not see.
  bad = f.layer;
  bad.rotary.scaling = RotaryScaling::dynamic_ntk;
  bad.rotary.factor = 2.0;
  bad.rotary.original_max_positions = 8;
  EXPECT_TRUE(testing::throws_error([&] { attend_partial(in, bad, out); }, ErrorCode::unsupported,
                                    {"attend_partial", "'rotary.scaling'", "inverse_frequencies"}));
}

}  // namespace
}  // namespace emflow
