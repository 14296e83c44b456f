// The device-resident flow (Device::cuda) held against the host run_flow and the host observe():
// continuous SA / USA on the sphere and in R^d, Euler and RK4, a stack of layers with every
// normalisation, pre- and post-norm, several heads, per-cloud betas, float and double; the
// observables on clouds built to have known clusters; bitwise determinism; records every k
// steps and the last one; progress; and the errors, which match the host's. GPU tests start
// with EMFLOW_REQUIRE_CUDA() and skip without a device; the checks that hold on every device
// (FlowCuda/FlowOnEveryDevice.*) run once per device, the CUDA instance skipping without one.
// Cases are tiny (the CPU emulation runs one host thread per CUDA thread).
//
// Tolerances for the trajectory against the CPU run: the attention of the two devices differs
// by rounding (float: a few 1e-7 relative per evaluation; double: a few 1e-16), and ten steps of
// dt <= 0.1 with O(1) Lipschitz constants amplify that by well under 10: float 1e-4, double
// 1e-10 leave a wide margin and still catch any wrong term (an error of one term is O(dt)).
// Observables are computed on the GPU's own recorded clouds by both sides, in double, in a
// different order: 1e-12 relative; cluster counts exactly.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "common/flow_helpers.hpp"
#include "common/testing.hpp"
#include "emflow/error.hpp"
#include "emflow/flow.hpp"

namespace emflow::flow {
namespace {

using testing::continuous;
using testing::on;
using testing::random_layer;

template <class T>
double tolerance() {
  return sizeof(T) == sizeof(float) ? 1e-4 : 1e-10;
}

::testing::AssertionResult near(const char* field, double got, double want, double relative) {
  const double bound = relative * std::max(1.0, std::abs(want));
  if (std::abs(got - want) <= bound) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << field << ": got " << got << ", want " << want << " (bound " << bound << ")";
}

// Every observable but the entropy, against the host's observe() on the same cloud.
void expect_observables(const Observables& got, const Observables& want, const std::string& what) {
  constexpr double rel = 1e-12;
  EXPECT_TRUE(near("min_inner", got.min_inner, want.min_inner, rel)) << what;
  EXPECT_TRUE(near("mean_inner", got.mean_inner, want.mean_inner, rel)) << what;
  EXPECT_EQ(got.clustered_fraction, want.clustered_fraction) << what;
  EXPECT_EQ(got.clusters, want.clusters) << what;
  EXPECT_TRUE(near("energy", got.energy, want.energy, rel)) << what;
  EXPECT_TRUE(near("diameter", got.diameter, want.diameter, rel)) << what;
}

// The GPU run against the CPU run of the same problem: records, trajectory, observables.
template <class T>
void expect_agree(const FlowResult<T>& gpu, const FlowResult<T>& cpu,
                  const std::vector<double>& betas, double cluster_eps, const std::string& what) {
  ASSERT_EQ(gpu.trajectory.shape(), cpu.trajectory.shape()) << what;
  EXPECT_EQ(gpu.times, cpu.times) << what;
  EXPECT_EQ(gpu.steps, cpu.steps) << what;
  // The problem itself is tame (finite energies too), so agreement means something.
  for (const Observables& o : cpu.observables) ASSERT_TRUE(std::isfinite(o.energy)) << what;
  ASSERT_TRUE(testing::all_finite_or_neg_inf(gpu.trajectory.values())) << what;
  const double tol = tolerance<T>();
  EXPECT_LT(testing::relative_error(gpu.trajectory.values(), cpu.trajectory.values()), tol) << what;

  const std::int64_t R = gpu.trajectory.extent(0), B = gpu.trajectory.extent(1);
  const std::int64_t N = gpu.trajectory.extent(2), d = gpu.trajectory.extent(3);
  // Not vacuous: the flow moved the clouds by far more than the tolerance.
  const std::vector<T>& all = cpu.trajectory.values();
  const std::vector<T> first(all.begin(), all.begin() + B * N * d);
  const std::vector<T> last(all.end() - B * N * d, all.end());
  EXPECT_GT(testing::relative_error(last, first), 100 * tol) << what << ": the clouds hardly moved";

  ASSERT_EQ(gpu.observables.size(), static_cast<std::size_t>(R * B)) << what;
  for (std::int64_t r = 0; r < R; ++r) {
    for (std::int64_t b = 0; b < B; ++b) {
      const std::string at = what + " record " + std::to_string(r) + " cloud " + std::to_string(b);
      const T* cloud = gpu.trajectory.data() + (r * B + b) * N * d;
      const auto e = static_cast<std::size_t>(r * B + b);
      expect_observables(gpu.observables[e],
                         observe(cloud, N, d, betas[static_cast<std::size_t>(b)], cluster_eps), at);
      EXPECT_GT(gpu.observables[e].entropy, 0.0) << at;
      EXPECT_TRUE(near("entropy", gpu.observables[e].entropy, cpu.observables[e].entropy, tol))
          << at;
    }
  }
}

// Runs the same problem on the CPU and the GPU and compares.
template <class T>
void check_run(const Tensor<T>& initial, const std::vector<double>& betas,
               const std::vector<FlowLayer<T>>& layers, const FlowSettings& settings,
               const std::string& what) {
  const auto cpu = run_flow(initial, betas, layers, settings, on(Device::cpu));
  const auto gpu = run_flow(initial, betas, layers, settings, on(Device::cuda));
  std::vector<double> per_cloud = betas;
  if (per_cloud.size() == 1)
    per_cloud.assign(static_cast<std::size_t>(initial.extent(0)), betas[0]);
  expect_agree(gpu, cpu, per_cloud, settings.cluster_eps, what);
}

template <class T>
class FlowCudaTyped : public ::testing::Test {};
using Precisions = ::testing::Types<float, double>;
TYPED_TEST_SUITE(FlowCudaTyped, Precisions);

// testing::clustered_clouds: three clouds of 33 tokens with 27, 4 and 1 clusters.
TYPED_TEST(FlowCudaTyped, ObservablesMatchHostObserveWithKnownClusters) {
  using T = TypeParam;
  EMFLOW_REQUIRE_CUDA();
  const Tensor<T> x0 = testing::clustered_clouds<T>();
  const std::vector<double> betas = {1.0, 2.0, 0.5};
  const std::int64_t N = 33, d = 5;
  // The constructions hold on the host (otherwise the test would check nothing).
  const std::int64_t want_clusters[] = {27, 4, 1};
  const double want_pairs[] = {12, 155, 32};
  for (std::int64_t b = 0; b < 3; ++b) {
    const Observables host = observe(x0.data() + b * N * d, N, d, betas[b]);
    ASSERT_EQ(host.clusters, want_clusters[b]) << "cloud " << b;
    ASSERT_EQ(host.clustered_fraction, want_pairs[b] / static_cast<double>(N * (N - 1) / 2))
        << "cloud " << b;
  }
  // Record 0 of a run is the initial state; a one-layer stack adds a second, moved state.
  FlowSettings s;
  s.layers = 1;
  const auto gpu = run_flow(x0, betas, {random_layer<T>(d, 1, 3, false)}, s, on(Device::cuda));
  ASSERT_EQ(gpu.trajectory.extent(0), 2);
  EXPECT_EQ(gpu.trajectory.values().front(), x0.values().front());
  for (std::int64_t r = 0; r < 2; ++r) {
    for (std::int64_t b = 0; b < 3; ++b) {
      const T* cloud = gpu.trajectory.data() + (r * 3 + b) * N * d;
      const Observables host = observe(cloud, N, d, betas[static_cast<std::size_t>(b)]);
      expect_observables(gpu.observables[static_cast<std::size_t>(r * 3 + b)], host,
                         "record " + std::to_string(r) + " cloud " + std::to_string(b));
    }
  }
  for (std::int64_t b = 0; b < 3; ++b) {
    EXPECT_EQ(gpu.observables[static_cast<std::size_t>(b)].clusters, want_clusters[b]);
  }
}

// More tokens than a block has threads (each thread takes several tokens in the final count)
// and seven 32-token tiles of pairs per token (testing::chain_and_groups: 6 clusters).
TEST(FlowCuda, ObservablesOfALargerCloud) {
  EMFLOW_REQUIRE_CUDA();
  constexpr std::int64_t N = 200, d = 3;
  const Tensor<float> x0 = testing::chain_and_groups();
  const Observables host = observe(x0.data(), N, d, 1.0);
  ASSERT_EQ(host.clusters, 6);
  ASSERT_EQ(host.clustered_fraction, 374.0 / static_cast<double>(N * (N - 1) / 2));
  FlowSettings s;
  s.layers = 1;
  const auto gpu = run_flow(x0, {1.0}, {random_layer<float>(d, 1, 4, false)}, s, on(Device::cuda));
  expect_observables(gpu.observables[0], host, "initial cloud");
  const Observables moved = observe(gpu.trajectory.data() + N * d, N, d, 1.0);
  expect_observables(gpu.observables[1], moved, "after one layer");
}

// Many clusters and a long chain, for the union-find that pair_rows joins the clustered pairs
// into: in the plane, a chain of 100 tokens 0.01 rad apart (neighbours clustered at eps = 1e-4,
// second neighbours not) under scrambled token indices, so that joins meet trees whose roots
// other threads are hooking; then 20 pairs and 60 single tokens in directions 0.06 rad apart.
// 81 clusters, 119 clustered pairs.
template <class T>
Tensor<T> chain_and_many_clusters() {
  constexpr std::int64_t N = 200, d = 2;
  std::vector<std::int64_t> order(N);
  for (std::int64_t k = 0; k < N; ++k) order[static_cast<std::size_t>(k)] = (k * 73) % N;
  Tensor<T> x({1, N, d});
  std::int64_t k = 0;
  const auto place = [&](double angle) {
    const std::int64_t i = order[static_cast<std::size_t>(k)];
    const double radius = 0.5 + 0.1 * static_cast<double>(k % 7);
    x.data()[i * d] = static_cast<T>(radius * std::cos(angle));
    x.data()[i * d + 1] = static_cast<T>(radius * std::sin(angle));
    ++k;
  };
  for (int c = 0; c < 100; ++c) place(0.01 * c);
  for (int g = 0; g < 80; ++g) {
    place(1.2 + 0.06 * g);
    if (g < 20) place(1.2 + 0.06 * g);
  }
  return x;
}

TYPED_TEST(FlowCudaTyped, ObservablesWithManyClustersAndALongChain) {
  using T = TypeParam;
  EMFLOW_REQUIRE_CUDA();
  constexpr std::int64_t N = 200, d = 2;
  constexpr double eps = 1e-4;
  const Tensor<T> x0 = chain_and_many_clusters<T>();
  const Observables host = observe(x0.data(), N, d, 1.0, eps);
  ASSERT_EQ(host.clusters, 81);
  ASSERT_EQ(host.clustered_fraction, 119.0 / static_cast<double>(N * (N - 1) / 2));
  FlowSettings s;
  s.layers = 1;
  s.cluster_eps = eps;
  const auto gpu = run_flow(x0, {1.0}, {random_layer<T>(d, 1, 5, false)}, s, on(Device::cuda));
  ASSERT_EQ(gpu.observables.size(), 2u);
  EXPECT_EQ(gpu.observables[0].clusters, 81);
  expect_observables(gpu.observables[0], host, "initial cloud");
  const Observables moved = observe(gpu.trajectory.data() + N * d, N, d, 1.0, eps);
  expect_observables(gpu.observables[1], moved, "after one layer");
}

TYPED_TEST(FlowCudaTyped, ContinuousOnTheSphereMatchesCpu) {
  using T = TypeParam;
  EMFLOW_REQUIRE_CUDA();
  const auto x0 = initial_clouds<T>(InitialCloud::sphere, 4, 9, 4, 5);
  // Clouds 0 and 1 share beta: one attend call for both.
  FlowSettings s = continuous(0.3, 0.1, Integrator::rk4, true);
  s.record_every = 2;  // steps 0, 2 and the last, 3
  check_run(x0, {1.0, 1.0, 2.0, 4.0}, {random_layer<T>(4, 2, 7, true, 2.0)}, s,
            "SA, RK4, sphere, 2 heads");
  // USA grows like exp(beta max s_ij): milder scores keep RK4 stable at dt = 0.1.
  s.unnormalized = true;
  check_run(x0, {0.5, 0.5, 1.0, 2.0}, {random_layer<T>(4, 2, 7, true, 1.0)}, s,
            "USA, RK4, sphere, 2 heads");
}

TYPED_TEST(FlowCudaTyped, ContinuousInEuclideanSpaceMatchesCpu) {
  using T = TypeParam;
  EMFLOW_REQUIRE_CUDA();
  const auto x0 = initial_clouds<T>(InitialCloud::gaussian, 3, 7, 3, 8);
  const std::vector<double> betas = {0.5, 1.0, 1.0};
  FlowSettings s = continuous(0.4, 0.1, Integrator::euler, false);
  const std::vector<FlowLayer<T>> layers = {random_layer<T>(3, 2, 9, true, 1.0)};
  check_run(x0, betas, layers, s, "SA, Euler, R^d, 2 heads, offset, key bias");
  s.unnormalized = true;
  check_run(x0, betas, layers, s, "USA, Euler, R^d, 2 heads, offset, key bias");
  s.integrator = Integrator::rk4;
  s.time = 0.25;  // a shorter last step
  check_run(x0, betas, layers, s, "USA, RK4, R^d");
}

TYPED_TEST(FlowCudaTyped, DiscreteStackWithEveryNormalisationMatchesCpu) {
  using T = TypeParam;
  EMFLOW_REQUIRE_CUDA();
  const auto x0 = initial_clouds<T>(InitialCloud::gaussian, 2, 6, 4, 10);
  const std::vector<double> betas = {0.5, 1.0};
  // Three layers of their own, heads 1, 2, 1: the last layer's operators give the final entropy.
  const std::vector<FlowLayer<T>> layers = {random_layer<T>(4, 1, 11, true),
                                            random_layer<T>(4, 2, 12, true),
                                            random_layer<T>(4, 1, 13, true)};
  for (Normalization norm : testing::every_normalization()) {
    for (bool pre_norm : {false, true}) {
      FlowSettings s = testing::stack(3, norm, pre_norm);
      s.unnormalized = norm == Normalization::rmsnorm;  // USA in a stack too
      check_run(x0, betas, layers, s,
                std::string(to_string(norm)) + (pre_norm ? " pre-norm" : " post-norm"));
    }
  }
}

class FlowOnEveryDevice : public ::testing::TestWithParam<Device> {};

template <class T>
void expect_deterministic(Device device) {
  const auto x0 = initial_clouds<T>(InitialCloud::sphere, 2, 9, 4, 12);
  FlowSettings s = continuous(0.3, 0.1, Integrator::rk4, true);
  const std::vector<FlowLayer<T>> layers = {random_layer<T>(4, 2, 14, false, 2.0)};
  const auto a = run_flow(x0, {1.0, 2.0}, layers, s, on(device));
  const auto b = run_flow(x0, {1.0, 2.0}, layers, s, on(device));
  ASSERT_EQ(a.trajectory.values().size(), b.trajectory.values().size());
  EXPECT_EQ(std::memcmp(a.trajectory.data(), b.trajectory.data(),
                        a.trajectory.values().size() * sizeof(T)),
            0);
  ASSERT_EQ(a.observables.size(), b.observables.size());
  for (std::size_t e = 0; e < a.observables.size(); ++e) {
    EXPECT_EQ(std::memcmp(&a.observables[e], &b.observables[e], sizeof(Observables)), 0) << e;
  }
}

TEST_P(FlowOnEveryDevice, RunsAreBitwiseDeterministic) {
  EMFLOW_REQUIRE_DEVICE(GetParam());
  expect_deterministic<float>(GetParam());
  expect_deterministic<double>(GetParam());
}

// A stack records steps 0, k, 2k, ... and the last, with progress after every step; so does a
// continuous run, its last time the sum of its steps.
TEST_P(FlowOnEveryDevice, RecordsEveryKStepsAndTheLast) {
  const Device device = GetParam();
  EMFLOW_REQUIRE_DEVICE(device);
  const auto x0 = initial_clouds<float>(InitialCloud::sphere, 1, 5, 3, 2);
  FlowSettings s;
  s.layers = 7;
  s.norm = Normalization::sphere;
  s.record_every = 3;
  std::vector<std::int64_t> progress;
  const auto r = run_flow(x0, {1.0}, {random_layer<float>(3, 1, 15, false, 2.0)}, s, on(device),
                          [&](std::int64_t done, std::int64_t all) {
                            EXPECT_EQ(all, 7);
                            progress.push_back(done);
                          });
  EXPECT_EQ(r.steps, (std::vector<std::int64_t>{0, 3, 6, 7}));
  EXPECT_EQ(r.times, (std::vector<double>{0, 3, 6, 7}));
  EXPECT_EQ(progress, (std::vector<std::int64_t>{1, 2, 3, 4, 5, 6, 7}));
  // The records are the states the CPU records at the same steps.
  const auto cpu =
      run_flow(x0, {1.0}, {random_layer<float>(3, 1, 15, false, 2.0)}, s, on(Device::cpu));
  EXPECT_LT(testing::relative_error(r.trajectory.values(), cpu.trajectory.values()), 1e-4);

  const auto x1 = initial_clouds<float>(InitialCloud::sphere, 2, 4, 3, 1);
  FlowSettings c = continuous(1.0, 0.1, Integrator::euler, true);
  c.record_every = 3;
  const std::vector<FlowLayer<float>> identity = {
      make_layer<float>(3, OperatorKind::identity, OperatorKind::identity, 1)};
  const auto t = run_flow(x1, {1.0}, identity, c, on(device));
  EXPECT_EQ(t.trajectory.shape(), (Shape{5, 2, 4, 3}));
  EXPECT_EQ(t.steps, (std::vector<std::int64_t>{0, 3, 6, 9, 10}));
  EXPECT_NEAR(t.times.back(), 1.0, 1e-12);
  EXPECT_EQ(std::vector<float>(t.trajectory.data(), t.trajectory.data() + 24), x1.values());
  for (const auto& o : t.observables) EXPECT_TRUE(std::isfinite(o.entropy));
}

INSTANTIATE_TEST_SUITE_P(FlowCuda, FlowOnEveryDevice, ::testing::ValuesIn(testing::flow_devices()),
                         testing::device_name);

TEST(FlowCuda, CpuAndGpuTrajectoriesAgree) {
  EMFLOW_REQUIRE_CUDA();
  const auto x0 = initial_clouds<float>(InitialCloud::sphere, 4, 32, 8, 5);
  const std::vector<FlowLayer<float>> layers = {
      make_layer<float>(8, OperatorKind::random, OperatorKind::identity, 6)};
  const FlowSettings s = continuous(1.0, 0.1, Integrator::rk4, true);
  check_run(x0, {1.0, 2.0, 4.0, 8.0}, layers, s, "Q K random, V = I, sphere");
}

// Validation is shared with the host run: the same arguments fail the same way on every device,
// before any device is touched (so this runs without a GPU too).
TEST(FlowCuda, InvalidArgumentsFailAsOnTheHost) {
  const auto x0 = initial_clouds<float>(InitialCloud::sphere, 2, 5, 3, 2);
  const std::vector<FlowLayer<float>> layers = {random_layer<float>(3, 1, 16, false)};
  FlowSettings s = continuous(1.0, 0.1, Integrator::rk4, true);
  auto message = [&](const std::vector<double>& betas, const FlowSettings& settings,
                     Device device) -> std::string {
    try {
      run_flow(x0, betas, layers, settings, on(device));
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
      return e.what();
    }
    return "no error";
  };
  FlowSettings bad_record = s;
  bad_record.record_every = 0;
  FlowSettings bad_norm = s;
  bad_norm.norm = Normalization::layernorm;
  for (const auto& [betas, settings] : {std::make_pair(std::vector<double>{1.0, -1.0}, s),
                                        std::make_pair(std::vector<double>{1.0, 2.0, 3.0}, s),
                                        std::make_pair(std::vector<double>{1.0}, bad_record),
                                        std::make_pair(std::vector<double>{1.0}, bad_norm)}) {
    const std::string cpu = message(betas, settings, Device::cpu);
    EXPECT_NE(cpu, "no error");
    EXPECT_EQ(message(betas, settings, Device::cuda), cpu);
  }
}

TEST(FlowCuda, CudaWithoutADeviceIsAClearError) {
  std::string reason;
  if (testing::cuda_available(&reason)) GTEST_SKIP() << "a CUDA device is present";
  const auto x0 = initial_clouds<float>(InitialCloud::sphere, 1, 4, 3, 2);
  try {
    run_flow(x0, {1.0}, {random_layer<float>(3, 1, 17, false)},
             continuous(1.0, 0.1, Integrator::rk4, true), on(Device::cuda));
    FAIL() << "run_flow on Device::cuda without a device did not throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::unsupported);
    EXPECT_NE(std::string(e.what()).find("cuda"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace emflow::flow
