// Defects of the device flow that only a strict execution shows, each held by a test:
//   * the cluster decision at the threshold, bitwise the host's (no FMA contraction on either
//     side): a pair whose inner product rounds to either side of (1 - eps) |x_i| |x_j| depending
//     on whether a * b + c is fused; runs on a GPU too;
//   * 64-bit indices in the element-wise kernels: the last block of a grid over INT_MAX elements
//     (only that block runs, under the emulation, over memory mapped without being reserved);
//     an int index wraps there, which UBSan reports;
//   * recorded steps go through page-locked staging: no copy into pageable memory per record
//     (the emulation counts them).
// Under the emulation every test here also checks that host sources outlive their asynchronous
// copies (the layers' upload): a freed source is a use-after-free for AddressSanitizer.
#include <gtest/gtest.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "common/flow_helpers.hpp"
#include "common/testing.hpp"
#include "emflow/flow.hpp"

#if defined(EMFLOW_CUDA_EMULATION)
#include <cuda_runtime.h>

#include "kernels/flow_kernels.hpp"
#endif

namespace emflow::flow {
namespace {

using testing::on;
using testing::random_layer;

constexpr std::int64_t kDim = 8;

// The pair terms of two tokens by a rule: every product and sum rounded on its own (`fused`
// false), or each a * b + c fused as a contracting compiler does (`fused` true).
struct PairTerms {
  double inner, scale;
};
PairTerms pair_terms(const std::vector<double>& x, const std::vector<double>& y, bool fused) {
  double g = 0.0, sx = 0.0, sy = 0.0;
  for (std::size_t a = 0; a < x.size(); ++a) {
    if (fused) {
      g = std::fma(x[a], y[a], g);
      sx = std::fma(x[a], x[a], sx);
      sy = std::fma(y[a], y[a], sy);
    } else {
      volatile double p = x[a] * y[a], px = x[a] * x[a], py = y[a] * y[a];
      g = g + p;
      sx = sx + px;
      sy = sy + py;
    }
  }
  return {g, std::sqrt(sx) * std::sqrt(sy)};
}
bool clustered(const PairTerms& t, double eps) {
  return t.scale > 0.0 && t.inner > (1.0 - eps) * t.scale;
}

// Two nearly parallel tokens and an eps whose threshold lies between the two rules' inner
// products: the rounded rule and the fused one decide the pair differently.
struct Threshold {
  std::vector<double> x, y;
  double eps = 0.0;
};
Threshold split_threshold() {
  std::mt19937_64 random(12345);
  std::uniform_real_distribution<double> uniform(-1.0, 1.0);
  for (int attempt = 0; attempt < 100000; ++attempt) {
    Threshold t;
    for (std::int64_t a = 0; a < kDim; ++a) {
      t.x.push_back(uniform(random));
      t.y.push_back(t.x.back() + 1e-3 * uniform(random));
    }
    const PairTerms rounded = pair_terms(t.x, t.y, false), fused = pair_terms(t.x, t.y, true);
    if (rounded.inner == fused.inner) continue;
    const double eps0 = 1.0 - rounded.inner / rounded.scale;
    double eps = eps0;
    for (int step = 0; step < 64; ++step, eps = std::nextafter(eps, 1.0)) {
      if (clustered(rounded, eps) != clustered(fused, eps)) {
        t.eps = eps;
        return t;
      }
    }
    eps = eps0;
    for (int step = 0; step < 64; ++step, eps = std::nextafter(eps, 0.0)) {
      if (clustered(rounded, eps) != clustered(fused, eps)) {
        t.eps = eps;
        return t;
      }
    }
  }
  return {};
}

TEST(FlowCudaRounding, ClusterDecisionsAtTheThresholdAreTheHostsBitForBit) {
  EMFLOW_REQUIRE_CUDA();
  const Threshold t = split_threshold();
  ASSERT_GT(t.eps, 0.0) << "no pair found whose decision depends on FMA contraction";
  const bool rounded = clustered(pair_terms(t.x, t.y, false), t.eps);
  ASSERT_NE(rounded, clustered(pair_terms(t.x, t.y, true), t.eps));  // the case is a real one
  Tensor<double> x0({1, 2, kDim});
  for (std::int64_t a = 0; a < kDim; ++a) {
    x0.data()[a] = t.x[static_cast<std::size_t>(a)];
    x0.data()[kDim + a] = t.y[static_cast<std::size_t>(a)];
  }
  // The host's observe() follows the rounded rule.
  const Observables host = observe(x0.data(), 2, kDim, 1.0, t.eps);
  ASSERT_EQ(host.clustered_fraction, rounded ? 1.0 : 0.0);
  ASSERT_EQ(host.clusters, rounded ? 1 : 2);
  FlowSettings s;
  s.layers = 1;
  s.cluster_eps = t.eps;
  const auto gpu =
      run_flow(x0, {1.0}, {random_layer<double>(kDim, 1, 7, false)}, s, on(Device::cuda));
  ASSERT_EQ(gpu.observables.size(), 2u);
  EXPECT_EQ(gpu.observables[0].clustered_fraction, host.clustered_fraction);
  EXPECT_EQ(gpu.observables[0].clusters, host.clusters);
}

#if defined(EMFLOW_CUDA_EMULATION)

// Device memory of `count` elements; past 1 GiB the emulation maps it without reserving it.
template <class T>
struct Large {
  T* data = nullptr;
  explicit Large(std::size_t count) {
    EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&data), count * sizeof(T)), cudaSuccess);
  }
  ~Large() { cudaFree(data); }
};

// Runs the queued kernels of `stream` with only the last block of each grid.
void run_last_blocks(cudaStream_t stream) {
  emu::only_last_blocks = 1;
  const cudaError_t status = cudaStreamSynchronize(stream);
  emu::only_last_blocks = 0;
  ASSERT_EQ(status, cudaSuccess);
}

TEST(FlowCudaIndexing, ElementwiseKernelsIndexPastIntMaxWithoutWrapping) {
  constexpr int n = INT_MAX;
  const auto count = static_cast<std::size_t>(n);
  Large<float> a(count), b(count), c(count), d(count), e(count);
  ASSERT_NE(e.data, nullptr);
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  // The last element, which the last block writes: poisoned until then.
  a.data[count - 1] = 1.0f;
  b.data[count - 1] = 2.0f;
  c.data[count - 1] = 3.0f;
  d.data[count - 1] = 4.0f;
  detail::launch_axpy<float>(e.data, a.data, b.data, 0.5f, n, s);  // 1 + 0.5 * 2 = 2
  run_last_blocks(s);
  EXPECT_EQ(e.data[count - 1], 2.0f);
  detail::launch_add<float>(e.data, a.data, n, s);  // 3
  run_last_blocks(s);
  EXPECT_EQ(e.data[count - 1], 3.0f);
  detail::launch_rk4_combine<float>(e.data, a.data, b.data, c.data, d.data, 1.0f, n, s);
  run_last_blocks(s);  // 3 + (1 + 2 (2 + 3) + 4) = 18
  EXPECT_EQ(e.data[count - 1], 18.0f);
  // One token of one value per row: normalize, tangent, the USA accumulation at d = 1.
  detail::launch_normalize<float>(Normalization::rmsnorm, a.data, e.data, n, 1, nullptr, nullptr,
                                  s);
  run_last_blocks(s);  // 1 / sqrt(1 + 1e-5)
  EXPECT_NEAR(e.data[count - 1], 1.0 / std::sqrt(1.0 + 1e-5), 1e-6);
  d.data[count - 1] = 0.25f;
  detail::launch_tangent<float>(a.data, d.data, n, 1, s);  // 0.25 - 0.25 * 1 = 0
  run_last_blocks(s);
  EXPECT_EQ(d.data[count - 1], 0.0f);
  c.data[count - 1] = static_cast<float>(std::log(2.0));
  detail::launch_usa_accumulate<float>(e.data, b.data, c.data, std::log(2.0), true, n, 1, s);
  run_last_blocks(s);  // exp(log 2 - log 2) * 2
  EXPECT_NEAR(e.data[count - 1], 2.0f, 1e-6);
  cudaStreamDestroy(s);
}

TEST(FlowCudaStaging, RecordsAreNotCopiedIntoPageableMemory) {
  constexpr std::int64_t N = 16, d = 3;
  Tensor<float> x0({2, N, d});
  const std::vector<double> values = testing::uniform(static_cast<std::size_t>(2 * N * d), 3);
  for (std::size_t e = 0; e < values.size(); ++e) x0.data()[e] = static_cast<float>(values[e]);
  const auto pageable_copies = [&](std::int64_t layers) {
    FlowSettings s;
    s.layers = layers;
    std::vector<FlowLayer<float>> stack;
    for (std::int64_t l = 0; l < layers; ++l) {
      stack.push_back(random_layer<float>(d, 1, static_cast<std::uint64_t>(l + 1), false));
    }
    const long before = emu::counters.pageable_device_to_host;
    const auto gpu = run_flow(x0, {1.0}, stack, s, on(Device::cuda));
    EXPECT_EQ(gpu.trajectory.extent(0), layers + 1);
    // The trajectory is what was recorded: its first state is the initial cloud.
    EXPECT_EQ(gpu.trajectory.values().front(), x0.values().front());
    EXPECT_EQ(gpu.trajectory.values()[static_cast<std::size_t>(2 * N * d - 1)], x0.values().back());
    return emu::counters.pageable_device_to_host - before;
  };
  // One pageable copy per run (the observables at the end), however many records.
  EXPECT_EQ(pageable_copies(1), pageable_copies(5));
  EXPECT_LE(pageable_copies(5), 1);
}

#endif  // EMFLOW_CUDA_EMULATION

}  // namespace
}  // namespace emflow::flow
