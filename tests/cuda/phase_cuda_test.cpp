// The GPU sweep of the phase diagram (kernels/phase_kernels.cu) held against the specialised CPU
// path and the generic path through attend: small sweeps over awkward cloud sizes (one cloud per
// warp, several per warp, one spilling into a second warp), d = 2 and 3 (compiled dimensions)
// and 5 (the run-time dimension), determinism on every device, launches split for progress
// reports, the generic path in device memory, the fallback for clouds too large for a block,
// and the dispatch without a device.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <ostream>
#include <sstream>
#include <string>
#include <vector>

#include "common/flow_helpers.hpp"
#include "common/testing.hpp"
#include "emflow/error.hpp"
#include "emflow/flow.hpp"
#include "flow/internal.hpp"

#if defined(EMFLOW_WITH_CUDA)
#include "kernels/phase_kernels.hpp"
#endif

namespace emflow::flow {
namespace {

using testing::well_formed;

// One thread: the CPU paths' results do not depend on it, and the emulation runs faster.
ExecutionOptions on(Device device) { return testing::on(device, 1); }

struct SweepCase {
  std::int64_t tokens, dim;
};

std::ostream& operator<<(std::ostream& os, const SweepCase& c) {
  return os << "n" << c.tokens << "_d" << c.dim;
}

// 8 clouds, 3 betas, 8 RK4 steps: small enough for the emulation. eps = 0.05 so that pairs
// cross the threshold within T = 2 and the comparison is not between two rows of zeros.
PhaseSettings small_sweep(std::int64_t tokens, std::int64_t dim) {
  PhaseSettings s = testing::phase_settings(tokens, dim, 0.5, 8.0, 3, 4.0, 0.5, 8, 11);
  s.cluster_eps = 0.05;
  return s;
}

class PhaseCudaPaths : public ::testing::TestWithParam<SweepCase> {};

// The GPU and the CPU integrate the same equations in float32 with sums in different orders, so
// trajectories agree to about 1e-6 and a pair's count can differ only when its inner product
// lies that close to the threshold. Over 8 clouds and 9 records such a pair is rare; allow one
// pair in one cloud per entry, as the CPU path is held to the generic one. The t = 0 row is
// computed from the same float clouds and must agree exactly.
TEST_P(PhaseCudaPaths, MatchesCpuAndGenericPaths) {
  EMFLOW_REQUIRE_CUDA();
  const SweepCase c = GetParam();
  const PhaseSettings s = small_sweep(c.tokens, c.dim);
  const PhaseDiagram gpu = phase_diagram(s, on(Device::cuda));
  const PhaseDiagram cpu = phase_diagram(s, on(Device::cpu));
  const PhaseDiagram generic = phase_diagram_generic(s, on(Device::cpu));
  ASSERT_TRUE(well_formed(gpu, 9, 3));
  ASSERT_EQ(gpu.times, cpu.times);
  ASSERT_EQ(gpu.betas, cpu.betas);
  const double pairs = 0.5 * static_cast<double>(c.tokens * (c.tokens - 1));
  const double one_pair = 1.0 / (pairs * static_cast<double>(s.clouds));
  for (std::size_t k = 0; k < 3; ++k) {
    EXPECT_NEAR(gpu.clustered[k], cpu.clustered[k], 1e-12) << "t = 0, beta " << k;
  }
  EXPECT_LE(testing::max_abs_difference(gpu.clustered, cpu.clustered), 1.01 * one_pair);
  EXPECT_LE(testing::max_abs_difference(gpu.clustered, generic.clustered), 1.01 * one_pair);
  // Not a comparison of two constant rows: at the largest beta the clouds cluster.
  EXPECT_GT(gpu.clustered[8 * 3 + 2], gpu.clustered[2]) << "no clustering at beta = 8";
}

INSTANTIATE_TEST_SUITE_P(PhaseCuda, PhaseCudaPaths,
                         ::testing::Values(SweepCase{2, 2}, SweepCase{7, 2}, SweepCase{32, 2},
                                           SweepCase{33, 2}, SweepCase{2, 3}, SweepCase{7, 3},
                                           SweepCase{32, 3}, SweepCase{33, 3}, SweepCase{7, 5},
                                           SweepCase{33, 5}),
                         [](const ::testing::TestParamInfo<SweepCase>& info) {
                           std::ostringstream name;
                           name << info.param;
                           return name.str();
                         });

// Integer counts summed by atomics (GPU) and lane sums in a fixed order (CPU) do not depend on
// the schedule: two runs are bitwise equal on every device, and Device::automatic takes the GPU
// kernel when a device is present.
class PhaseOnEveryDevice : public ::testing::TestWithParam<Device> {};

TEST_P(PhaseOnEveryDevice, Deterministic) {
  const Device device = GetParam();
  EMFLOW_REQUIRE_DEVICE(device);
  const PhaseSettings s = small_sweep(9, 2);
  const PhaseDiagram first = phase_diagram(s, on(device));
  ASSERT_TRUE(well_formed(first, 9, 3));
  EXPECT_EQ(first.clustered, phase_diagram(s, on(device)).clustered);
  if (device == Device::cuda) {
    EXPECT_EQ(first.clustered, phase_diagram(s, on(Device::automatic)).clustered);
  }
}

INSTANTIATE_TEST_SUITE_P(PhaseCuda, PhaseOnEveryDevice,
                         ::testing::ValuesIn(testing::flow_devices()), testing::device_name);

// The generic path in device memory (one attend_async per beta and RK4 stage) against the
// generic path on the host: the same equations, float rounding apart; one pair in one cloud.
// Two clouds: the path launches once per cloud, beta and stage, and the CPU emulation of CUDA
// (CI) spends about 0.15 s a launch; eight clouds took it 111 s.
TEST(PhaseCudaSweep, GenericPathOnTheDeviceMatchesTheHost) {
  EMFLOW_REQUIRE_CUDA();
  PhaseSettings s = small_sweep(7, 3);
  s.clouds = 2;
  const PhaseDiagram device = phase_diagram_generic(s, on(Device::cuda));
  const PhaseDiagram host = phase_diagram_generic(s, on(Device::cpu));
  ASSERT_TRUE(well_formed(device, 9, 3));
  EXPECT_EQ(device.times, host.times);
  const double one_pair = 1.0 / (0.5 * 7.0 * 6.0 * static_cast<double>(s.clouds));
  EXPECT_LE(testing::max_abs_difference(device.clustered, host.clustered), 1.01 * one_pair);
  EXPECT_GT(device.clustered[8 * 3 + 2], device.clustered[2]) << "no clustering at beta = 8";
}

// With a progress callback the steps run in several launches, the state kept in device memory
// between them; the result is bitwise the single launch's, and the reports climb to (S, S).
TEST(PhaseCudaSweep, ProgressSplitsLaunchesWithoutChangingTheResult) {
  EMFLOW_REQUIRE_CUDA();
  PhaseSettings s = small_sweep(7, 3);
  s.time = 10.0;  // 20 steps: twenty launches of one
  const PhaseDiagram whole = phase_diagram(s, on(Device::cuda));
  std::vector<std::int64_t> done;
  const PhaseDiagram split =
      phase_diagram(s, on(Device::cuda), [&](std::int64_t d, std::int64_t total) {
        EXPECT_EQ(total, 20);
        done.push_back(d);
      });
  ASSERT_TRUE(well_formed(split, 21, 3));
  EXPECT_EQ(split.clustered, whole.clustered);
  ASSERT_GE(done.size(), 2u);
  for (std::size_t e = 1; e < done.size(); ++e) EXPECT_GT(done[e], done[e - 1]);
  EXPECT_EQ(done.back(), 20);
}

// d = 100: eight clouds of 16 tokens would need 300 KiB of shared memory, so the kernel takes
// fewer clouds per block (four). eps = 0.9: in d = 100 inner products spread about 0.1 around 0,
// so a threshold of 0.1 counts a fair share of the pairs from the start.
TEST(PhaseCudaSweep, ManyDimensionsTakeFewerCloudsPerBlock) {
  EMFLOW_REQUIRE_CUDA();
  PhaseSettings s = small_sweep(16, 100);
  s.beta_count = 1;
  s.beta_start = s.beta_stop = 8.0;
  s.cluster_eps = 0.9;
  const PhaseDiagram gpu = phase_diagram(s, on(Device::cuda));
  const PhaseDiagram cpu = phase_diagram(s, on(Device::cpu));
  ASSERT_TRUE(well_formed(gpu, 9, 1));
  const double one_pair = 1.0 / (0.5 * 16.0 * 15.0 * 8.0);
  EXPECT_LE(testing::max_abs_difference(gpu.clustered, cpu.clustered), 1.01 * one_pair);
  EXPECT_GT(gpu.clustered[0], 0.05);
  EXPECT_GT(gpu.clustered[8], gpu.clustered[0]);
}

#if defined(EMFLOW_WITH_CUDA)
// The shared memory a block needs, without a device: N > 1024 does not fit one block's threads;
// N = 64 in d = 160 needs more than the 227 KiB a Hopper block may opt into.
TEST(PhaseCudaLayout, SharedBytes) {
  EXPECT_EQ(detail::phase_kernel_cuda_shared_bytes(1025, 2), 0u);
  EXPECT_GT(detail::phase_kernel_cuda_shared_bytes(1024, 2), 0u);
  EXPECT_LT(detail::phase_kernel_cuda_shared_bytes(32, 2), 48u * 1024u);
  EXPECT_GT(detail::phase_kernel_cuda_shared_bytes(64, 160), 232448u);
}

// A cloud too large for one block runs through attend on the device: the result is the generic
// path's on the device, bitwise, and agrees with the CPU path.
TEST(PhaseCudaSweep, LargeCloudFallsBackToTheGenericPath) {
  EMFLOW_REQUIRE_CUDA();
  ASSERT_FALSE(detail::phase_kernel_cuda_fits(64, 160));
  PhaseSettings s = small_sweep(64, 160);
  s.clouds = 1;
  s.beta_count = 1;
  s.beta_start = s.beta_stop = 4.0;
  s.time = 0.5;         // one step
  s.cluster_eps = 1.0;  // pairs at angles below 90 degrees: about half of them
  const PhaseDiagram fallback = phase_diagram(s, on(Device::cuda));
  const PhaseDiagram generic = phase_diagram_generic(s, on(Device::cuda));
  const PhaseDiagram cpu = phase_diagram(s, on(Device::cpu));
  ASSERT_TRUE(well_formed(fallback, 2, 1));
  EXPECT_EQ(fallback.clustered, generic.clustered);
  // The inner products spread around the threshold 0 with density about 5 (d = 160), so of the
  // 2016 pairs about 0.02 are expected within float rounding (1e-6) of it; allow ten.
  const double one_pair = 1.0 / (0.5 * 64.0 * 63.0);
  EXPECT_LE(testing::max_abs_difference(fallback.clustered, cpu.clustered), 10.01 * one_pair);
  EXPECT_GT(fallback.clustered[0], 0.3);
}
#endif

// Without a device, Device::cuda is refused (ErrorCode::unsupported) and Device::automatic
// takes the CPU path.
TEST(PhaseCudaNoDevice, CudaIsRefusedAndAutomaticRunsOnTheCpu) {
  std::string reason;
  if (testing::cuda_available(&reason)) GTEST_SKIP() << "a CUDA device is present";
  const PhaseSettings s = small_sweep(7, 2);
  try {
    phase_diagram(s, on(Device::cuda));
    ADD_FAILURE() << "Device::cuda ran without a device";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::unsupported) << e.what();
  }
  const PhaseDiagram automatic = phase_diagram(s, on(Device::automatic));
  const PhaseDiagram cpu = phase_diagram(s, on(Device::cpu));
  ASSERT_TRUE(well_formed(automatic, 9, 3));
  EXPECT_EQ(automatic.clustered, cpu.clustered);
}

}  // namespace
}  // namespace emflow::flow
