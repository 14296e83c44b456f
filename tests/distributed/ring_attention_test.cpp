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
