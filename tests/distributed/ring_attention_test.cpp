// Sequence-parallel attention over the job's ranks against emflow::attend over the whole batch
// in one process: every mask, ragged key lengths, float and double, both shard layouts, more
// ranks than some runs have tokens; bit-for-bit reproducible; a bad argument on one rank is the
// same error on every rank.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "comm.hpp"
#include "common/testing.hpp"
#include "emflow/attention.hpp"
#include "emflow/capability.hpp"
#include "emflow/factored.hpp"
#include "emflow/partial.hpp"
#include "emflow/sequence_parallel.hpp"

namespace emflow::testing {
namespace {

using distributed::Layout;

struct Case {
  std::int64_t batch, tokens, dim, heads;
  Mask mask;
  bool ragged;
  Layout layout;
};

std::string case_name(const Case& c) {
  return shape_name(c.batch, c.heads, c.tokens, c.dim, c.mask) + (c.ragged ? "_ragged" : "") +
         (c.layout == Layout::zigzag ? "_zigzag" : "_contiguous");
}

Problem make_problem(const Case& c) {
  Problem p = Problem::random(c.batch, c.tokens, c.dim, c.heads, 1234 + c.tokens);
  p.mask = c.mask;
  p.key_bias = true;
  p.offset = true;
  if (c.ragged) {
    // A full cloud, an empty one, a short one and one cut in the middle.
    const std::int64_t lengths[] = {c.tokens, 0, 1, c.tokens / 2 + 1};
    for (std::int64_t b = 0; b < c.batch; ++b) p.key_lengths.push_back(lengths[b % 4]);
  }
  return p;
}

template <class T>
struct Local {
  std::vector<T> update, lse, entropy;
};

template <class T>
Local<T> run_distributed(const Buffers<T>& whole, const Problem& p, Layout layout,
                         distributed::RingTimes* times = nullptr) {
  const auto segments = distributed::shard(layout, p.tokens, comm().size(), comm().rank());
  const std::int64_t local = distributed::shard_tokens(segments);
  const std::vector<T> cloud =
      distributed::gather_shard(whole.cloud.data(), p.batch, p.tokens, p.dim, segments);
  distributed::ShardInput<T> in;
  in.cloud = cloud.data();
  in.batch = p.batch;
  in.tokens = p.tokens;
  in.dim = p.dim;
  in.layer = whole.input.layer;
  in.beta = p.beta;
  in.mask = p.mask;
  in.key_lengths = whole.input.key_lengths;
  in.layout = layout;
  Local<T> out;
  out.update.assign(static_cast<std::size_t>(p.batch * local * p.dim), T(-7));
  out.lse.assign(static_cast<std::size_t>(p.batch * p.heads * local), T(-7));
  out.entropy.assign(out.lse.size(), T(-7));
  distributed::attend(comm(), in, {out.update.data(), out.lse.data(), out.entropy.data()},
                      ExecutionOptions{Device::cpu, 1}, times);
  return out;
}

template <class T>
void expect_matches_one_process(const Case& c) {
  const Problem p = make_problem(c);
  Buffers<T> whole(p);
  attend(whole.input, whole.output, ExecutionOptions{Device::cpu, 1});
  const Local<T> got = run_distributed(whole, p, c.layout);
  const auto segments = distributed::shard(c.layout, p.tokens, comm().size(), comm().rank());
  const double tolerance = sizeof(T) == 4 ? 1e-6 : 1e-12;
  if (!segments.empty()) {
    EXPECT_TRUE(
        close_to(got.update,
                 distributed::gather_shard(whole.update.data(), p.batch, p.tokens, p.dim, segments),
                 tolerance));
    // lse and entropy: (B H, N) rows, one value per token.
    EXPECT_TRUE(close_to(
        got.lse,
        distributed::gather_shard(whole.lse.data(), p.batch * p.heads, p.tokens, 1, segments),
        tolerance));
    EXPECT_TRUE(close_to(
        got.entropy,
        distributed::gather_shard(whole.entropy.data(), p.batch * p.heads, p.tokens, 1, segments),
        tolerance));
  }
  // The same bits on a second run.
  const Local<T> again = run_distributed(whole, p, c.layout);
  EXPECT_EQ(0, std::memcmp(again.update.data(), got.update.data(), got.update.size() * sizeof(T)));
  EXPECT_EQ(0, std::memcmp(again.lse.data(), got.lse.data(), got.lse.size() * sizeof(T)));
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (const Mask mask :
       {Mask::none(), Mask::causal(), Mask::sliding_window(3), Mask::sliding_window(40)}) {
    for (const Layout layout : {Layout::contiguous, Layout::zigzag}) {
      out.push_back({2, 37, 5, 2, mask, false, layout});
      out.push_back({4, 29, 3, 1, mask, true, layout});
    }
  }
  // Fewer tokens than runs: some ranks hold nothing.
  out.push_back({1, 5, 4, 1, Mask::causal(), false, Layout::zigzag});
  out.push_back({3, 3, 2, 2, Mask::none(), true, Layout::contiguous});
  return out;
}

class RingAttention : public ::testing::TestWithParam<Case> {};

TEST_P(RingAttention, FloatEqualsOneProcess) { expect_matches_one_process<float>(GetParam()); }
TEST_P(RingAttention, DoubleEqualsOneProcess) { expect_matches_one_process<double>(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Shapes, RingAttention, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return case_name(info.param); });

// A llama-like layer in the factored form (rotary positions over part of the rank, 2 query heads
// sharing 1 kv head, an offset) through the ring against attend_factored over the whole batch:
// every mask, both layouts, ragged lengths, float and double.
template <class T>
void expect_factored_matches_one_process(const Mask& mask, Layout layout) {
  const std::int64_t B = 3, N = 23, d = 6, H = 2, K = 1, r = 4;
  const auto values = [](std::size_t count, std::uint64_t seed) {
    const std::vector<double> u = uniform(count, seed);
    return std::vector<T>(u.begin(), u.end());
  };
  const std::vector<T> x = values(B * N * d, 1), a = values(H * r * d, 2), b = values(K * r * d, 3),
                       up = values(H * d * r, 4), down = values(K * r * d, 5),
                       offset = values(d, 6);
  const std::vector<std::int64_t> lengths{N, 0, 11};
  FactoredLayer<T> layer{H, r, a.data(), b.data(), up.data(), down.data(), nullptr, offset.data()};
  layer.kv_heads = K;
  layer.rotary.dim = 2;
  layer.rotary.base = 50.0;
  AttentionInput<T> whole_input;
  whole_input.cloud = x.data();
  whole_input.batch = B;
  whole_input.tokens = N;
  whole_input.dim = d;
  whole_input.beta = 1.3;
  whole_input.mask = mask;
  whole_input.key_lengths = lengths.data();
  std::vector<T> update(B * N * d, T(-7)), lse(B * H * N, T(-7)), entropy(lse.size(), T(-7));
  attend_factored(whole_input, layer, {update.data(), lse.data(), entropy.data()},
                  ExecutionOptions{Device::cpu, 1});
  // The rotation turns: the same layer without it gives another update, which the ring's must
  // not match.
  FactoredLayer<T> plain = layer;
  plain.rotary.dim = 0;
  std::vector<T> unturned(update.size());
  attend_factored(whole_input, plain, {unturned.data()}, ExecutionOptions{Device::cpu, 1});
  ASSERT_GT(relative_error(unturned, update), 1e-3);

  const auto segments = distributed::shard(layout, N, comm().size(), comm().rank());
  const std::int64_t local = distributed::shard_tokens(segments);
  const std::vector<T> cloud = distributed::gather_shard(x.data(), B, N, d, segments);
  distributed::ShardInput<T> in;
  in.cloud = cloud.data();
  in.batch = B;
  in.tokens = N;
  in.dim = d;
  in.beta = whole_input.beta;
  in.mask = mask;
  in.key_lengths = lengths.data();
  in.layout = layout;
  std::vector<T> got(B * local * d, T(-7)), got_lse(B * H * local, T(-7)),
      got_entropy(got_lse.size(), T(-7));
  distributed::attend(comm(), in, layer, {got.data(), got_lse.data(), got_entropy.data()},
                      ExecutionOptions{Device::cpu, 1});
  if (segments.empty()) return;
  const double tolerance = sizeof(T) == 4 ? 1e-6 : 1e-12;
  EXPECT_TRUE(
      close_to(got, distributed::gather_shard(update.data(), B, N, d, segments), tolerance));
  EXPECT_TRUE(
      close_to(got_lse, distributed::gather_shard(lse.data(), B * H, N, 1, segments), tolerance));
  EXPECT_TRUE(close_to(
      got_entropy, distributed::gather_shard(entropy.data(), B * H, N, 1, segments), tolerance));
}

TEST(RingAttentionFactored, RotaryAndGroupedHeadsEqualOneProcess) {
  for (const Mask mask : {Mask::none(), Mask::causal(), Mask::sliding_window(4)}) {
    for (const Layout layout : {Layout::contiguous, Layout::zigzag}) {
      SCOPED_TRACE(to_string(mask) + (layout == Layout::zigzag ? " zigzag" : " contiguous"));
      expect_factored_matches_one_process<float>(mask, layout);
      expect_factored_matches_one_process<double>(mask, layout);
    }
  }
}

// The ring turns each token at its position in the sequence: positions of its own are refused.
TEST(RingAttentionFactored, ExplicitRotaryPositionsAreRefusedByName) {
  const std::int64_t B = 1, N = 4, d = 2, H = 1, r = 2;
  const std::vector<float> x(B * N * d, 0.5f), f(H * r * d, 0.25f);
  const std::vector<std::int64_t> positions(B * N, 3);
  FactoredLayer<float> layer{H, r, f.data(), f.data(), f.data(), f.data()};
  layer.rotary.dim = 2;
  layer.rotary.key_positions = positions.data();
  const auto segments = distributed::shard(Layout::contiguous, N, comm().size(), comm().rank());
  const std::vector<float> cloud = distributed::gather_shard(x.data(), B, N, d, segments);
  distributed::ShardInput<float> in;
  in.cloud = cloud.data();
  in.batch = B;
  in.tokens = N;
  in.dim = d;
  std::vector<float> out(B * N * d);
  EXPECT_TRUE(throws_error([&] { distributed::attend(comm(), in, layer, {out.data()}); },
                           ErrorCode::invalid_argument, {"'rotary.key_positions'"}));
}

TEST(RingAttentionShards, CoverTheSequenceOnceAndZigzagBalancesCausalWork) {
  for (const int P : {1, 2, 3, 4, 8}) {
    for (const std::int64_t N : {1, 7, 64, 1001}) {
      for (const Layout layout : {Layout::contiguous, Layout::zigzag}) {
        std::vector<int> seen(static_cast<std::size_t>(N), 0);
        for (int r = 0; r < P; ++r) {
          for (const auto& s : distributed::shard(layout, N, P, r)) {
            for (std::int64_t i = s.position; i < s.position + s.count; ++i) ++seen[i];
          }
        }
        EXPECT_EQ(seen, std::vector<int>(seen.size(), 1)) << P << " " << N;
      }
      // Causal pairs (i, j <= i) each rank's queries see: within N + 2 of each other (runs may
      // differ by a token, which sees up to N keys); contiguous shards differ by about N^2 / P.
      std::int64_t low = INT64_MAX, high = 0;
      for (int r = 0; r < P; ++r) {
        std::int64_t pairs = 0;
        for (const auto& s : distributed::shard(Layout::zigzag, N, P, r)) {
          for (std::int64_t i = s.position; i < s.position + s.count; ++i) pairs += i + 1;
        }
        low = std::min(low, pairs);
        high = std::max(high, pairs);
      }
      if (N >= 2 * P) {
        EXPECT_LE(high - low, N + 2) << P << " " << N;
      }
    }
  }
}

TEST(RingAttentionErrors, ABadArgumentOnOneRankIsTheSameErrorOnEveryRank) {
  const Problem p = Problem::random(1, 16, 4, 1, 5);
  Buffers<double> whole(p);
  const int failing = comm().size() - 1;
  const auto segments = distributed::shard(Layout::contiguous, 16, comm().size(), comm().rank());
  const std::vector<double> cloud =
      distributed::gather_shard(whole.cloud.data(), 1, 16, 4, segments);
  std::vector<double> update(cloud.size());
  distributed::ShardInput<double> in;
  in.cloud = cloud.data();
  in.tokens = 16;
  in.dim = 4;
  in.layer = whole.input.layer;
  in.beta = comm().rank() == failing ? std::nan("") : 1.0;
  const std::string prefix = comm().size() > 1 ? "rank " + std::to_string(failing) + ": " : "";
  EXPECT_TRUE(throws_error(
      [&] {
        distributed::attend(comm(), in, {update.data(), nullptr, nullptr});
      },
      ErrorCode::invalid_argument, {prefix + "distributed attend: argument 'beta'"}));
}

// ShardInput is an AttentionInput with a layout (code that sets its fields one by one, as above,
// keeps compiling), and ShardOutput's statistics have the type of every other lse.
static_assert(std::is_base_of_v<AttentionInput<float>, distributed::ShardInput<float>>);
static_assert(std::is_same_v<decltype(distributed::ShardOutput<float>::lse), float*>);
static_assert(std::is_same_v<decltype(distributed::ShardOutput<double>::entropy), double*>);

TEST(RingAttentionErrors, TheCrossAttentionFieldsOfTheInputAreRefused) {
  const Problem p = Problem::random(1, 8, 3, 1, 6);
  Buffers<double> whole(p);
  std::vector<double> update(whole.cloud.size());
  distributed::ShardInput<double> in;
  in.cloud = whole.cloud.data();
  in.tokens = 8;
  in.dim = 3;
  in.layer = whole.input.layer;
  in.key_position = 4;
  EXPECT_TRUE(throws_error(
      [&] {
        distributed::attend(comm(), in, {update.data(), nullptr, nullptr});
      },
      ErrorCode::invalid_argument, {"distributed attend: argument 'queries'", "defaults"}));
}

// The ring's partial states run on the device route() names for the whole batch's partial state:
// every device is either taken (the result is attend's) or refused with route()'s reason on every
// rank. Without a GPU, cuda is refused as missing.
TEST(RingAttention, RunsOnTheDeviceRouteNames) {
  const Case c{2, 13, 4, 2, Mask::causal(), false, Layout::zigzag};
  const Problem p = make_problem(c);
  Buffers<double> whole(p);
  attend(whole.input, whole.output, ExecutionOptions{Device::reference});
  const auto segments = distributed::shard(c.layout, p.tokens, comm().size(), comm().rank());
  const std::vector<double> cloud =
      distributed::gather_shard(whole.cloud.data(), p.batch, p.tokens, p.dim, segments);
  distributed::ShardInput<double> in;
  in.cloud = cloud.data();
  in.batch = p.batch;
  in.tokens = p.tokens;
  in.dim = p.dim;
  in.layer = whole.input.layer;
  in.mask = p.mask;
  in.layout = c.layout;
  for (Device device : {Device::automatic, Device::cpu, Device::reference, Device::cuda}) {
    emflow::Problem problem = describe(static_cast<const AttentionInput<double>&>(in),
                                       PartialOutput<double>{}, ExecutionOptions{device});
    problem.lse = problem.entropy = true;
    const Route want = route(problem, device, "distributed attend");
    std::vector<double> update(cloud.size(), std::nan(""));
    try {
      distributed::attend(comm(), in, {update.data(), nullptr, nullptr},
                          ExecutionOptions{device, 1});
    } catch (const Error& e) {
      EXPECT_FALSE(want.supported) << to_string(device) << ": " << e.what();
      EXPECT_EQ(e.code(), ErrorCode::unsupported) << e.what();
      EXPECT_NE(std::string(e.what()).find(want.reason), std::string::npos) << e.what();
      continue;
    }
    EXPECT_TRUE(want.supported) << to_string(device) << " ran; route() says " << to_string(want);
    if (!segments.empty()) {
      EXPECT_TRUE(close_to(
          update,
          distributed::gather_shard(whole.update.data(), p.batch, p.tokens, p.dim, segments),
          1e-12))
          << to_string(device);
    }
  }
}

}  // namespace
}  // namespace emflow::testing
