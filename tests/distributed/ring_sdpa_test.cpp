// The SDPA-shaped operator over the job's ranks (sequence_parallel.hpp: distributed::sdpa_attend
// and distributed::sdpa_backward) against emflow::sdpa_attend and emflow::sdpa_backward over the
// whole sequence in one process: every mask, ragged key lengths with padding queries and an
// empty cloud, grouped heads, a value rank unlike the rank, float and double, both shard layouts,
// more ranks than some runs have tokens; the same bits on a second run; refusals by name on
// every rank.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "comm.hpp"
#include "common/testing.hpp"
#include "emflow/sdpa.hpp"
#include "emflow/sequence_parallel.hpp"

namespace emflow::testing {
namespace {

using distributed::Layout;

struct SdpaCase {
  std::int64_t batch, query_heads, kv_heads, tokens, rank, value_rank;
  Mask mask;
  bool ragged;
  Layout layout;
};

std::string case_name(const SdpaCase& c) {
  return shape_name(c.batch, c.query_heads, c.tokens, c.rank, c.mask) + "_kv" +
         std::to_string(c.kv_heads) + "_rv" + std::to_string(c.value_rank) +
         (c.ragged ? "_ragged" : "") + (c.layout == Layout::zigzag ? "_zigzag" : "_contiguous");
}

template <class T>
std::vector<T> values_of(std::int64_t count, std::uint64_t seed) {
  const std::vector<double> u = uniform(static_cast<std::size_t>(count), seed);
  return std::vector<T>(u.begin(), u.end());
}

// Everything of one case over the whole sequence, computed in one process.
template <class T>
struct Whole {
  std::vector<T> Q, K, V, O, dO, dQ, dK, dV;
  std::vector<Stat<T>> lse, entropy, dlse, dH;
  std::vector<std::int64_t> lengths;
  double dscale = 0.0;
  SdpaInput<T> input;

  explicit Whole(const SdpaCase& c) {
    const std::int64_t B = c.batch, H = c.query_heads, K_ = c.kv_heads, N = c.tokens;
    Q = values_of<T>(B * H * N * c.rank, 1);
    K = values_of<T>(B * K_ * N * c.rank, 2);
    V = values_of<T>(B * K_ * N * c.value_rank, 3);
    if (c.ragged) {
      // A full cloud, an empty one, a short one and one cut in the middle.
      const std::int64_t cuts[] = {N, 0, 1, N / 2 + 1};
      for (std::int64_t b = 0; b < B; ++b) lengths.push_back(cuts[b % 4]);
    }
    input.queries = Q.data();
    input.keys = K.data();
    input.values = V.data();
    input.batch = B;
    input.query_heads = H;
    input.kv_heads = K_;
    input.query_tokens = N;
    input.tokens = N;
    input.rank = c.rank;
    input.value_rank = c.value_rank;
    input.scale = 0.7;
    input.mask = c.mask;
    // The ring's rule: token t at position t as query and key, padding queries see no key.
    input.query_position = 0;
    if (c.ragged) input.key_lengths = input.query_lengths = lengths.data();
    O.assign(static_cast<std::size_t>(B * H * N * c.value_rank), T(-7));
    lse.assign(static_cast<std::size_t>(B * H * N), Stat<T>(-7));
    entropy.assign(lse.size(), Stat<T>(-7));
    sdpa_attend(input, {O.data(), lse.data(), entropy.data()}, ExecutionOptions{Device::cpu, 1});
    dO = values_of<T>(B * H * N * c.value_rank, 4);
    const std::vector<T> l = values_of<T>(B * H * N, 5), e = values_of<T>(B * H * N, 6);
    dlse.assign(l.begin(), l.end());
    dH.assign(e.begin(), e.end());
    dQ.assign(Q.size(), T(-7));
    dK.assign(K.size(), T(-7));
    dV.assign(V.size(), T(-7));
    sdpa_backward(input, {O.data(), lse.data(), entropy.data()},
                  {dO.data(), dlse.data(), dH.data()}, {dQ.data(), dK.data(), dV.data(), &dscale},
                  ExecutionOptions{Device::cpu, 1});
  }
};

// This rank's share of a (batch * heads, N, width) array.
template <class T>
std::vector<T> mine(const std::vector<T>& whole, const SdpaCase& c, std::int64_t heads,
                    std::int64_t width) {
  const auto segments = distributed::shard(c.layout, c.tokens, comm().size(), comm().rank());
  return distributed::gather_shard(whole.data(), c.batch * heads, c.tokens, width, segments);
}

template <class T>
struct Ring {
  std::vector<T> Q, K, V, O, dO, dQ, dK, dV;
  std::vector<Stat<T>> lse, entropy, dlse, dH;
  double dscale = 0.0;
};

template <class T>
Ring<T> run_ring(const Whole<T>& whole, const SdpaCase& c) {
  Ring<T> ring;
  const std::int64_t H = c.query_heads, K = c.kv_heads;
  ring.Q = mine(whole.Q, c, H, c.rank);
  ring.K = mine(whole.K, c, K, c.rank);
  ring.V = mine(whole.V, c, K, c.value_rank);
  distributed::SdpaShardInput<T> in;
  in.queries = ring.Q.data();
  in.keys = ring.K.data();
  in.values = ring.V.data();
  in.batch = c.batch;
  in.query_heads = H;
  in.kv_heads = K;
  in.tokens = c.tokens;
  in.rank = c.rank;
  in.value_rank = c.value_rank;
  in.scale = whole.input.scale;
  in.mask = c.mask;
  in.key_lengths = c.ragged ? whole.lengths.data() : nullptr;
  in.layout = c.layout;
  const std::size_t rows = ring.Q.size() / static_cast<std::size_t>(c.rank);
  ring.O.assign(rows * static_cast<std::size_t>(c.value_rank), T(-7));
  ring.lse.assign(rows, Stat<T>(-7));
  ring.entropy.assign(rows, Stat<T>(-7));
  distributed::sdpa_attend(comm(), in, {ring.O.data(), ring.lse.data(), ring.entropy.data()},
                           ExecutionOptions{Device::cpu, 1});
  ring.dO = mine(whole.dO, c, H, c.value_rank);
  ring.dlse = mine(whole.dlse, c, H, 1);
  ring.dH = mine(whole.dH, c, H, 1);
  ring.dQ.assign(ring.Q.size(), T(-7));
  ring.dK.assign(ring.K.size(), T(-7));
  ring.dV.assign(ring.V.size(), T(-7));
  // The ring's own forward pass is what its backward pass reads.
  distributed::sdpa_backward(comm(), in, {ring.O.data(), ring.lse.data(), ring.entropy.data()},
                             {ring.dO.data(), ring.dlse.data(), ring.dH.data()},
                             {ring.dQ.data(), ring.dK.data(), ring.dV.data(), &ring.dscale},
                             ExecutionOptions{Device::cpu, 1});
  return ring;
}

template <class T>
void expect_ring_equals_one_process(const SdpaCase& c) {
  const Whole<T> whole(c);
  ASSERT_GT(max_abs_difference(whole.dK, std::vector<T>(whole.dK.size(), T(0))), 1e-3)
      << "a vacuous comparison";
  const Ring<T> got = run_ring(whole, c);
  const double forward = sizeof(T) == 4 ? 1e-6 : 1e-12, backward = sizeof(T) == 4 ? 1e-5 : 1e-12;
  const std::int64_t H = c.query_heads, K = c.kv_heads;
  EXPECT_TRUE(close_to(got.O, mine(whole.O, c, H, c.value_rank), forward)) << "O";
  EXPECT_TRUE(close_to(got.lse, mine(whole.lse, c, H, 1), forward)) << "lse";
  EXPECT_TRUE(close_to(got.entropy, mine(whole.entropy, c, H, 1), forward)) << "entropy";
  EXPECT_TRUE(close_to(got.dQ, mine(whole.dQ, c, H, c.rank), backward)) << "dQ";
  EXPECT_TRUE(close_to(got.dK, mine(whole.dK, c, K, c.rank), backward)) << "dK";
  EXPECT_TRUE(close_to(got.dV, mine(whole.dV, c, K, c.value_rank), backward)) << "dV";
  EXPECT_NEAR(got.dscale, whole.dscale, backward * std::max(1.0, std::abs(whole.dscale)));
  // The same bits on a second run.
  const Ring<T> again = run_ring(whole, c);
  EXPECT_EQ(0, std::memcmp(again.O.data(), got.O.data(), got.O.size() * sizeof(T)));
  EXPECT_EQ(0, std::memcmp(again.dQ.data(), got.dQ.data(), got.dQ.size() * sizeof(T)));
  EXPECT_EQ(0, std::memcmp(again.dK.data(), got.dK.data(), got.dK.size() * sizeof(T)));
  EXPECT_EQ(0, std::memcmp(again.dV.data(), got.dV.data(), got.dV.size() * sizeof(T)));
  EXPECT_EQ(again.dscale, got.dscale);
}

std::vector<SdpaCase> cases() {
  std::vector<SdpaCase> out;
  for (const Mask mask : {Mask::none(), Mask::causal(), Mask::sliding_window(3)}) {
    for (const Layout layout : {Layout::contiguous, Layout::zigzag}) {
      out.push_back({2, 4, 2, 23, 5, 3, mask, false, layout});
      out.push_back({4, 2, 1, 17, 3, 4, mask, true, layout});
    }
  }
  // Fewer tokens than runs: some ranks hold nothing.
  out.push_back({1, 1, 1, 5, 4, 4, Mask::causal(), false, Layout::zigzag});
  out.push_back({3, 2, 2, 3, 2, 2, Mask::none(), true, Layout::contiguous});
  return out;
}

class RingSdpa : public ::testing::TestWithParam<SdpaCase> {};

TEST_P(RingSdpa, FloatForwardAndBackwardEqualOneProcess) {
  expect_ring_equals_one_process<float>(GetParam());
}
TEST_P(RingSdpa, DoubleForwardAndBackwardEqualOneProcess) {
  expect_ring_equals_one_process<double>(GetParam());
}

INSTANTIATE_TEST_SUITE_P(Shapes, RingSdpa, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return case_name(info.param); });

TEST(RingSdpaErrors, ABadArgumentOnOneRankIsTheSameErrorOnEveryRank) {
  const SdpaCase c{1, 2, 1, 12, 3, 3, Mask::causal(), false, Layout::contiguous};
  const Whole<double> whole(c);
  Ring<double> ring;
  ring.Q = mine(whole.Q, c, 2, 3);
  ring.K = mine(whole.K, c, 1, 3);
  ring.V = mine(whole.V, c, 1, 3);
  distributed::SdpaShardInput<double> in;
  in.queries = ring.Q.data();
  in.keys = ring.K.data();
  in.values = ring.V.data();
  in.query_heads = 2;
  in.tokens = 12;
  in.rank = in.value_rank = 3;
  const int failing = comm().size() - 1;
  in.scale = comm().rank() == failing ? std::nan("") : 1.0;
  std::vector<double> out(ring.Q.size(), 0.0);
  const std::string prefix = comm().size() > 1 ? "rank " + std::to_string(failing) + ": " : "";
  EXPECT_TRUE(throws_error([&] { distributed::sdpa_attend(comm(), in, {out.data()}); },
                           ErrorCode::invalid_argument,
                           {prefix + "distributed sdpa_attend: argument 'scale'"}));
  // The queries are the shard's own: cross-attention fields are refused, and the reference
  // (which recomputes each block's statistics) is refused for the backward pass.
  in.scale = 1.0;
  in.query_position = 0;
  EXPECT_TRUE(throws_error([&] { distributed::sdpa_attend(comm(), in, {out.data()}); },
                           ErrorCode::invalid_argument, {"'query_tokens'", "defaults"}));
  in.query_position = kAlignToEnd;
  std::vector<double> lse(ring.Q.size() / 3, 0.0), dK(ring.K.size()), dV(ring.V.size());
  EXPECT_TRUE(throws_error(
      [&] {
        distributed::sdpa_backward(
            comm(), in, {out.data(), lse.data(), nullptr}, {out.data(), nullptr, nullptr},
            {out.data(), dK.data(), dV.data()}, ExecutionOptions{Device::reference});
      },
      ErrorCode::unsupported, {"Device::reference"}));
}

}  // namespace
}  // namespace emflow::testing
