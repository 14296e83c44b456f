// The flow over part of every cloud (emflow/flow_parts.hpp): observables summed over parts of
// the rows equal flow::observe of the whole cloud (the clusters, which join across parts,
// exactly); a PartRun whose one part is the whole cloud, its operations emflow::attend and the
// sums of one part, is flow::run_flow on the host bit for bit, for stacks and continuous time,
// SA and USA; bad arguments are named. The split across processes is tested in
// tests/distributed (flow_test.cpp), over the same seam.
#include "emflow/flow_parts.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "common/flow_helpers.hpp"
#include "common/testing.hpp"

namespace emflow::testing {
namespace {

TEST(FlowParts, ObservablesOfPartsAreThoseOfTheWholeCloud) {
  const Tensor<double> clouds = clustered_clouds<double>();
  const std::int64_t B = clouds.extent(0), N = clouds.extent(1), d = clouds.extent(2);
  const std::vector<double> betas = {0.5, 1.0, 3.0};
  // Three parts of uneven runs that cover every row once, one of them in two runs.
  const std::vector<std::vector<flow::RowRun>> rows = {{{0, 5}, {29, 4}}, {{5, 17}}, {{22, 7}}};
  std::vector<std::vector<flow::PairSums>> parts;
  for (const auto& part : rows)
    parts.push_back(flow::pair_sums(clouds.data(), B, N, d, betas, 1e-3, part));
  for (std::int64_t b = 0; b < B; ++b) {
    SCOPED_TRACE("cloud " + std::to_string(b));
    std::vector<const flow::PairSums*> of_cloud;
    for (const auto& part : parts) of_cloud.push_back(&part[static_cast<std::size_t>(b)]);
    const double beta = betas[static_cast<std::size_t>(b)];
    const flow::Observables split = flow::observables_from_parts(of_cloud, N, beta);
    const flow::Observables whole = flow::observe(clouds.data() + b * N * d, N, d, beta);
    EXPECT_EQ(split.clusters, whole.clusters);
    EXPECT_EQ(split.clustered_fraction, whole.clustered_fraction);
    EXPECT_EQ(split.min_inner, whole.min_inner);
    EXPECT_EQ(split.diameter, whole.diameter);
    EXPECT_NEAR(split.mean_inner, whole.mean_inner, 1e-14 * (1 + std::abs(whole.mean_inner)));
    EXPECT_NEAR(split.energy, whole.energy, 1e-14 * whole.energy);
    // One part of every row, in order, is observe() itself, bit for bit.
    const std::vector<flow::PairSums> one =
        flow::pair_sums(clouds.data() + b * N * d, 1, N, d, {beta}, 1e-3, {{0, N}});
    const flow::Observables same = flow::observables_from_parts({&one[0]}, N, beta);
    EXPECT_EQ(same.mean_inner, whole.mean_inner);
    EXPECT_EQ(same.energy, whole.energy);
  }
}

// One part holding every row: its operations are what run_flow does in one process.
template <class T>
class WholeCloud final : public flow::PartOperations<T> {
 public:
  WholeCloud(std::int64_t tokens, std::int64_t dim, std::vector<double> betas)
      : tokens_(tokens), dim_(dim), betas_(std::move(betas)) {}
  void attend(const AttentionInput<T>& in, const AttentionOutput<T>& out) override {
    ++attends;
    AttentionOutput<T> all = out;  // the host run asks the CPU backend for both, always
    const auto stats = static_cast<std::size_t>(in.batch * in.layer.heads * in.tokens);
    lse_.resize(stats);
    entropy_.resize(stats);
    if (all.lse == nullptr) all.lse = lse_.data();
    if (all.entropy == nullptr) all.entropy = entropy_.data();
    ExecutionOptions options = on_cpu();
    options.threads = 1;
    emflow::attend(in, all, options);
  }
  void sum_over_parts(double*, std::int64_t) override { ++sums; }
  void observe(const T* rows, std::int64_t, flow::Observables* out) override {
    const auto B = static_cast<std::int64_t>(betas_.size());
    for (std::int64_t b = 0; b < B; ++b) {
      out[b] = flow::observe(rows + b * tokens_ * dim_, tokens_, dim_,
                             betas_[static_cast<std::size_t>(b)]);
    }
  }
  int attends = 0, sums = 0;

 private:
  std::int64_t tokens_, dim_;
  std::vector<double> betas_;
  std::vector<T> lse_, entropy_;
};

struct RunCase {
  const char* name;
  flow::FlowSettings settings;
};

class FlowPartRun : public ::testing::TestWithParam<RunCase> {};

TEST_P(FlowPartRun, OnePartIsRunFlowBitForBit) {
  flow::FlowSettings s = GetParam().settings;
  const Tensor<float> initial =
      flow::initial_clouds<float>(flow::InitialCloud::gaussian, 2, 9, 4, 3);
  const std::vector<flow::FlowLayer<float>> layers = {random_layer<float>(4, 2, 5, true),
                                                      random_layer<float>(4, 2, 6, true)};
  const std::vector<flow::FlowLayer<float>> used(layers.begin(),
                                                 layers.begin() + (s.layers > 0 ? 2 : 1));
  const std::vector<double> betas = {0.7, 1.3};
  ExecutionOptions options = on_cpu();
  options.threads = 1;
  const flow::FlowResult<float> expected = flow::run_flow(initial, betas, used, s, options);

  flow::PartRun<float> run(initial.shape(), 9, betas, used, s);
  EXPECT_EQ(run.records(), expected.trajectory.extent(0));
  WholeCloud<float> whole(9, 4, run.betas());
  const flow::FlowResult<float> part = run.run(whole, initial.data());
  EXPECT_GT(whole.attends, 0);
  EXPECT_GT(whole.sums, 0);
  EXPECT_EQ(part.trajectory.values(), expected.trajectory.values());
  EXPECT_EQ(part.times, expected.times);
  EXPECT_EQ(part.steps, expected.steps);
  ASSERT_EQ(part.observables.size(), expected.observables.size());
  for (std::size_t e = 0; e < part.observables.size(); ++e) {
    EXPECT_EQ(part.observables[e].entropy, expected.observables[e].entropy) << e;
    EXPECT_EQ(part.observables[e].energy, expected.observables[e].energy) << e;
    EXPECT_EQ(part.observables[e].clusters, expected.observables[e].clusters) << e;
  }
  EXPECT_TRUE(throws_error([&] { run.run(whole, initial.data()); }, ErrorCode::invalid_argument,
                           {"runs once"}));
}

flow::FlowSettings usa_time() {
  flow::FlowSettings s = continuous(0.3, 0.1, flow::Integrator::rk4, true);
  s.unnormalized = true;
  s.record_every = 2;
  return s;
}

INSTANTIATE_TEST_SUITE_P(
    Runs, FlowPartRun,
    ::testing::Values(RunCase{"post_layernorm", stack(2, flow::Normalization::layernorm, false)},
                      RunCase{"pre_rmsnorm", stack(2, flow::Normalization::rmsnorm, true)},
                      RunCase{"sphere_rk4", continuous(0.3, 0.1, flow::Integrator::rk4, true)},
                      RunCase{"usa_sphere_rk4", usa_time()}),
    [](const ::testing::TestParamInfo<RunCase>& info) { return std::string(info.param.name); });

TEST(FlowPartRun, RefusesBadArgumentsByName) {
  const std::vector<flow::FlowLayer<float>> layers = {random_layer<float>(3, 1, 5, false)};
  const flow::FlowSettings s = stack(1, flow::Normalization::none, false);
  EXPECT_TRUE(throws_error(
      [&] {
        flow::PartRun<float>(Shape{1, 8, 3}, 0, {1.0}, layers, s);
      },
      ErrorCode::invalid_argument, {"argument 'part_tokens' must be in [1, 8], got 0"}));
  EXPECT_TRUE(throws_error(
      [&] {
        flow::PartRun<float>(Shape{1, 8, 3}, 4, {-1.0}, layers, s);
      },
      ErrorCode::invalid_argument, {"run_flow", "argument 'beta'"}));
  flow::FlowSettings many = continuous(1.0, 1e-7, flow::Integrator::euler, false);
  EXPECT_TRUE(throws_error(
      [&] {
        flow::PartRun<float>(Shape{1, 128, 3}, 1, {1.0}, layers, many);
      },
      ErrorCode::invalid_argument, {"trajectory"}));
  const Tensor<double> clouds = clustered_clouds<double>();
  EXPECT_TRUE(throws_error(
      [&] {
        flow::pair_sums(clouds.data(), 3, 33, 5, {1.0, 1.0, 1.0}, 1e-3, {{30, 4}});
      },
      ErrorCode::invalid_argument, {"argument 'rows' run [30, 34)"}));
  EXPECT_TRUE(throws_error([&] { flow::observables_from_parts({}, 33, 1.0); },
                           ErrorCode::invalid_argument, {"argument 'parts'"}));
}

}  // namespace
}  // namespace emflow::testing
