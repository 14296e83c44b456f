// Helpers of the flow's tests, host and device alike: execution options, settings, layers and
// clouds with known properties, phase sweeps, and the devices a comparison runs on.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "common/testing.hpp"
#include "emflow/flow.hpp"

namespace emflow::testing {

/// Options for `device` (threads 0: the library's choice).
ExecutionOptions on(Device device, int threads = 0);
inline ExecutionOptions on_cpu() { return on(Device::cpu); }

/// Continuous time up to `time` with step `dt`, in R^d or on the sphere.
flow::FlowSettings continuous(double time, double dt, flow::Integrator integrator, bool sphere);

/// A stack of `layers` layers with normalisation `norm`, post-norm or pre-norm.
flow::FlowSettings stack(std::int64_t layers, flow::Normalization norm, bool pre_norm);
/// none, layernorm, rmsnorm, sphere.
std::vector<flow::Normalization> every_normalization();

/// A layer of `heads` heads with operator entries uniform in +-scale / sqrt(d); with `extras`,
/// a key bias, an offset and a norm gain and bias too.
template <class T>
flow::FlowLayer<T> random_layer(std::int64_t d, std::int64_t heads, std::uint64_t seed, bool extras,
                                double scale = 1.0);

/// Three clouds of 33 tokens in R^5 (two 32-token words of pair bits) with known clusters:
///   0: random tokens, two groups of four (one token of the second a longer copy, same
///      direction), so 12 clustered pairs and 33 - 6 = 27 clusters;
///   1: every token one of three directions, one token zero (no direction: in no pair), so
///      55 + 45 + 55 = 155 clustered pairs and 4 clusters;
///   2: a chain on a circle, 0.03 rad apart (cosine 0.99955 > 1 - 1e-3; two apart 0.9982 is
///      not), tokens in a shuffled order, so one cluster that takes several hooking rounds.
template <class T>
Tensor<T> clustered_clouds();

/// One cloud of 200 tokens in R^3: a shuffled chain of 150 tokens 0.03 rad apart on a circle
/// (one cluster that needs many hooking rounds) and five groups of ten identical tokens off the
/// chain's plane: 6 clusters, 149 + 5 * 45 = 374 clustered pairs.
Tensor<float> chain_and_groups();

/// A phase sweep of `clouds` clouds of `tokens` tokens in R^dim over `beta_count` betas in
/// [beta_start, beta_stop], RK4 with step dt up to `time`.
flow::PhaseSettings phase_settings(std::int64_t tokens, std::int64_t dim, double beta_start,
                                   double beta_stop, std::int64_t beta_count, double time,
                                   double dt, std::int64_t clouds, std::uint64_t seed);

/// Every fraction of the diagram written, finite and in [0, 1]; the grid (times x K).
::testing::AssertionResult well_formed(const flow::PhaseDiagram& p, std::size_t times,
                                       std::size_t K);

/// The devices a flow runs on: the host (Device::cpu) and the CUDA device. A test instantiated
/// over them skips the CUDA instance with the reason when no device is usable.
std::vector<Device> flow_devices();
/// gtest's name of a device parameter ("cpu", "cuda").
std::string device_name(const ::testing::TestParamInfo<Device>& info);

}  // namespace emflow::testing

namespace emflow {
/// How gtest prints a Device parameter ("cpu", "cuda").
inline void PrintTo(Device device, std::ostream* out) { *out << to_string(device); }
}  // namespace emflow

/// Use at the top of a test over flow_devices(): skips Device::cuda without a device.
#define EMFLOW_REQUIRE_DEVICE(device)                            \
  do {                                                           \
    std::string emflow_skip_reason;                              \
    if ((device) == ::emflow::Device::cuda &&                    \
        !::emflow::testing::cuda_available(&emflow_skip_reason)) \
      GTEST_SKIP() << "no CUDA device: " << emflow_skip_reason;  \
  } while (0)
