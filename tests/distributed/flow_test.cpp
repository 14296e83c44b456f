// The flow with the tokens spread over the job's ranks against flow::run_flow in one process:
// continuous time (SA and USA, Euler and RK4, on the sphere and in R^d) and stacks (every
// normalisation, post- and pre-norm, several heads, key bias and offset), float and double.
// The flow has no mask and no key lengths, so those are not varied. The trajectory agrees to
// rounding, the integer observables exactly; a second run gives the same bits; a bad argument
// on one rank is the same error on every rank.
#include "emflow/flow.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "comm.hpp"
#include "common/flow_helpers.hpp"
#include "common/testing.hpp"
#include "emflow/distributed_flow.hpp"
#include "emflow/sequence_parallel.hpp"

namespace emflow::testing {
namespace {

using distributed::Layout;

struct FlowCase {
  std::string name;
  flow::FlowSettings settings;
  std::int64_t heads = 1;
  bool extras = false;  // key bias, offset, norm gain and bias
  std::int64_t layer_count = 1;
};

std::vector<FlowCase> cases() {
  std::vector<FlowCase> out;
  out.push_back({"sa_sphere_rk4", continuous(0.6, 0.2, flow::Integrator::rk4, true)});
  FlowCase usa{"usa_euler_heads", continuous(0.4, 0.1, flow::Integrator::euler, false), 2, true};
  usa.settings.unnormalized = true;
  usa.settings.record_every = 2;
  out.push_back(usa);
  // Every normalisation once, post- and pre-norm alternating (the norms act per token, so the
  // placement adds nothing across ranks that one of each does not show).
  bool pre = false;
  for (const flow::Normalization norm : every_normalization()) {
    out.push_back({std::string("stack_") + flow::to_string(norm) + (pre ? "_pre" : "_post"),
                   stack(2, norm, pre), 2, true, 2});
    pre = !pre;
  }
  return out;
}

template <class T>
void expect_same_flow(const FlowCase& c, const Tensor<T>& initial, double beta, double tolerance) {
  SCOPED_TRACE(c.name);
  const std::int64_t B = initial.extent(0), N = initial.extent(1), d = initial.extent(2);
  std::vector<flow::FlowLayer<T>> layers;
  for (std::int64_t l = 0; l < c.layer_count; ++l) {
    layers.push_back(
        random_layer<T>(d, c.heads, 100 + static_cast<std::uint64_t>(l), c.extras, 0.8));
  }
  std::vector<double> betas;
  for (std::int64_t b = 0; b < B; ++b) betas.push_back(beta * (b < 2 ? 1.0 : 1.5));
  const ExecutionOptions cpu{Device::cpu, 1};
  const flow::FlowResult<T> one = flow::run_flow(initial, betas, layers, c.settings, cpu);

  const auto segments = distributed::shard(Layout::contiguous, N, comm().size(), comm().rank());
  const std::vector<T> mine = distributed::gather_shard(initial.data(), B, N, d, segments);
  const flow::FlowResult<T> many =
      distributed::run_flow(comm(), mine.data(), B, N, d, betas, layers, c.settings, cpu);
  const std::int64_t R = one.trajectory.extent(0);
  ASSERT_EQ(many.times, one.times);
  ASSERT_EQ(many.steps, one.steps);
  if (comm().rank() == 0) {
    ASSERT_EQ(many.trajectory.shape(), one.trajectory.shape());
    EXPECT_TRUE(close_to(many.trajectory.values(), one.trajectory.values(), tolerance));
  } else {
    // This rank's rows of every record.
    std::vector<T> expected;
    for (std::int64_t r = 0; r < R; ++r) {
      const auto rows =
          distributed::gather_shard(one.trajectory.data() + r * B * N * d, B, N, d, segments);
      expected.insert(expected.end(), rows.begin(), rows.end());
    }
    EXPECT_TRUE(close_to(many.trajectory.values(), expected, tolerance));
  }
  ASSERT_EQ(many.observables.size(), one.observables.size());
  bool moved = false;
  for (std::size_t e = 0; e < one.observables.size(); ++e) {
    const flow::Observables &a = many.observables[e], &b = one.observables[e];
    SCOPED_TRACE("observables " + std::to_string(e));
    EXPECT_EQ(a.clusters, b.clusters);
    EXPECT_EQ(a.clustered_fraction, b.clustered_fraction);
    for (const auto& [x, y] : {std::pair{a.min_inner, b.min_inner},
                               {a.mean_inner, b.mean_inner},
                               {a.energy, b.energy},
                               {a.entropy, b.entropy},
                               {a.diameter, b.diameter}}) {
      // The energy sums exp(beta <x_i, x_j>): it scales the state's rounding by beta |<x_i, x_j>|
      // (up to about 6 for the rmsnorm stacks here).
      EXPECT_NEAR(x, y, 10 * tolerance * std::max(1.0, std::abs(y)));
    }
    moved |= a.energy != many.observables[e % static_cast<std::size_t>(B)].energy;
  }
  EXPECT_TRUE(moved) << "the flow left every cloud where it was";
  EXPECT_GT(one.observables.back().entropy, 0.0);

  // Run to run: the same bits.
  const flow::FlowResult<T> again =
      distributed::run_flow(comm(), mine.data(), B, N, d, betas, layers, c.settings, cpu);
  EXPECT_EQ(again.trajectory.values(), many.trajectory.values());
  for (std::size_t e = 0; e < one.observables.size(); ++e) {
    const flow::Observables &a = again.observables[e], &b = many.observables[e];
    EXPECT_EQ(a.min_inner, b.min_inner);
    EXPECT_EQ(a.mean_inner, b.mean_inner);
    EXPECT_EQ(a.energy, b.energy);
    EXPECT_EQ(a.entropy, b.entropy);
    EXPECT_EQ(a.diameter, b.diameter);
    EXPECT_EQ(a.clusters, b.clusters);
  }
}

TEST(DistributedFlow, FloatMatchesOneProcess) {
  const Tensor<float> initial =
      flow::initial_clouds<float>(flow::InitialCloud::sphere, 3, 13, 4, 3);
  for (const FlowCase& c : cases()) expect_same_flow(c, initial, 1.0, 1e-6);
}

TEST(DistributedFlow, DoubleMatchesOneProcess) {
  const Tensor<double> initial =
      flow::initial_clouds<double>(flow::InitialCloud::gaussian, 2, 17, 3, 5);
  for (const FlowCase& c : cases()) expect_same_flow(c, initial, 2.0, 1e-12);
}

// Clouds with known clusters (up to 155 clustered pairs in 4 clusters, a chain that joins across
// the shards): the forests of the ranks merge into the clusters of one process.
TEST(DistributedFlow, ClustersAcrossRanksMatchOneProcess) {
  const Tensor<double> initial = clustered_clouds<double>();
  // In R^d: cloud 1 holds a zero token, which has no direction to project onto the sphere.
  FlowCase c{"clustered", continuous(0.1, 0.05, flow::Integrator::rk4, false)};
  const std::int64_t B = initial.extent(0), N = initial.extent(1), d = initial.extent(2);
  const std::vector<flow::FlowLayer<double>> layers = {
      flow::make_layer<double>(d, flow::OperatorKind::identity, flow::OperatorKind::identity, 0)};
  const flow::FlowResult<double> one =
      flow::run_flow(initial, {1.0}, layers, c.settings, {Device::cpu, 1});
  const auto segments = distributed::shard(Layout::contiguous, N, comm().size(), comm().rank());
  const std::vector<double> mine = distributed::gather_shard(initial.data(), B, N, d, segments);
  const flow::FlowResult<double> many =
      distributed::run_flow(comm(), mine.data(), B, N, d, {1.0}, layers, c.settings);
  // At the start: the clusters of flow_helpers.hpp.
  EXPECT_EQ(many.observables[0].clusters, 27);
  EXPECT_EQ(many.observables[1].clusters, 4);
  EXPECT_EQ(many.observables[2].clusters, 1);
  for (std::size_t e = 0; e < one.observables.size(); ++e) {
    EXPECT_EQ(many.observables[e].clusters, one.observables[e].clusters) << e;
    EXPECT_EQ(many.observables[e].clustered_fraction, one.observables[e].clustered_fraction) << e;
  }
}

TEST(DistributedFlow, BadArgumentOnOneRankIsTheSameErrorEverywhere) {
  const Tensor<double> initial =
      flow::initial_clouds<double>(flow::InitialCloud::sphere, 1, 8, 3, 1);
  const auto segments = distributed::shard(Layout::contiguous, 8, comm().size(), comm().rank());
  const std::vector<double> mine = distributed::gather_shard(initial.data(), 1, 8, 3, segments);
  const std::vector<flow::FlowLayer<double>> layers = {
      flow::make_layer<double>(3, flow::OperatorKind::identity, flow::OperatorKind::identity, 0)};
  flow::FlowSettings s = continuous(0.2, 0.1, flow::Integrator::rk4, true);
  const int failing = comm().size() - 1;
  if (comm().rank() == failing) s.dt = -1.0;
  // With more than one rank the settings differ between the ranks, which is named first.
  const std::string what = comm().size() > 1 ? "argument 'settings'" : "argument 'dt'";
  EXPECT_TRUE(
      throws_error([&] { distributed::run_flow(comm(), mine.data(), 1, 8, 3, {1.0}, layers, s); },
                   ErrorCode::invalid_argument, {"run_flow", what}));
  // Fewer tokens than ranks: refused on every rank alike.
  if (comm().size() > 2) {
    const auto few = distributed::shard(Layout::contiguous, 2, comm().size(), comm().rank());
    const std::vector<double> rows(static_cast<std::size_t>(shard_tokens(few) * 3 + 1), 0.5);
    EXPECT_TRUE(throws_error(
        [&] {
          distributed::run_flow(comm(), rows.data(), 1, 2, 3, {1.0}, layers,
                                continuous(0.2, 0.1, flow::Integrator::rk4, true));
        },
        ErrorCode::invalid_argument, {"argument 'tokens'", "number of ranks"}));
  }
}

}  // namespace
}  // namespace emflow::testing
