// The phase sweep split across the job's ranks by (beta, cloud) pairs: the diagram of one
// process bit for bit, whatever the rank count; parts of the pairs add up to the whole.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "comm.hpp"
#include "common/testing.hpp"
#include "emflow/distributed_flow.hpp"
#include "emflow/flow.hpp"

namespace emflow::testing {
namespace {

flow::PhaseSettings small_sweep() {
  flow::PhaseSettings s;
  s.tokens = 9;
  s.dim = 3;
  s.beta_start = 0.5;
  s.beta_stop = 6.0;
  s.beta_count = 7;
  s.clouds = 23;  // 161 pairs: ragged lane groups and ragged shares
  s.time = 3.0;
  s.dt = 0.25;
  s.seed = 7;
  return s;
}

TEST(DistributedPhase, SameDiagramBitForBitAsOneProcess) {
  const flow::PhaseSettings s = small_sweep();
  const flow::PhaseDiagram one = flow::phase_diagram(s, {Device::cpu, 1});
  const flow::PhaseDiagram two_threads = flow::phase_diagram(s, {Device::cpu, 2});
  const flow::PhaseDiagram many = distributed::phase_diagram(comm(), s, {Device::cpu, 1});
  EXPECT_EQ(many.clustered, one.clustered);
  EXPECT_EQ(two_threads.clustered, one.clustered);
  EXPECT_EQ(many.times, one.times);
  EXPECT_EQ(many.betas, one.betas);
  // Not a trivial diagram: some pairs cluster by the end, and not all at the start.
  const std::size_t K = one.betas.size(), last = one.times.size() - 1;
  EXPECT_GT(one.clustered[last * K + K - 1], 0.01);
  EXPECT_LT(one.clustered[0], 0.5);
}

TEST(DistributedPhase, CountsOfPartsAddUpToTheWhole) {
  const flow::PhaseSettings s = small_sweep();
  const std::int64_t total = s.clouds * s.beta_count;
  const std::vector<std::int64_t> whole = flow::phase_counts(s, 0, total, {Device::cpu, 1});
  std::vector<std::int64_t> sum(whole.size(), 0);
  for (const std::int64_t cut :
       {std::int64_t{0}, std::int64_t{5}, std::int64_t{17}, std::int64_t{100}, total}) {
    static std::int64_t previous = 0;
    if (cut == 0) previous = 0;
    const auto part = flow::phase_counts(s, previous, cut, {Device::cpu, 1});
    for (std::size_t e = 0; e < sum.size(); ++e) sum[e] += part[e];
    previous = cut;
  }
  EXPECT_EQ(sum, whole);
  EXPECT_EQ(flow::phase_from_counts(s, whole).clustered,
            flow::phase_diagram(s, {Device::cpu, 1}).clustered);
}

TEST(DistributedPhase, BadSettingsOnEveryRankAreOneError) {
  flow::PhaseSettings s = small_sweep();
  s.dt = -1;
  EXPECT_TRUE(throws_error([&] { distributed::phase_diagram(comm(), s); },
                           ErrorCode::invalid_argument, {"dt"}));
}

}  // namespace
}  // namespace emflow::testing
