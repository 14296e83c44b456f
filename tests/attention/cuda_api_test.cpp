// What only the CUDA backend has: the stream-ordered API's argument checks (workspace size and
// alignment, host pointers, outputs that overlap inputs, each other or the workspace), the
// workspace query (no device needed), a CUDA error the caller left pending, calls sharing one
// stream and workspace, and the clear error without a device. Its accuracy is checked with every
// other backend's (attention_test.cpp, properties_test.cpp).
#include <gtest/gtest.h>

#if defined(EMFLOW_WITH_CUDA)
#include <cuda_runtime.h>
#endif

#include <string>
#include <vector>

#include "attention/backends.hpp"
#include "attention/checks.hpp"
#include "common/testing.hpp"
#include "emflow/attention.hpp"
#include "emflow/error.hpp"

namespace emflow::testing {
namespace {

TEST(CudaWithoutDevice, AttendOnCudaIsAClearUnsupportedError) {
  std::string reason;
  if (cuda_available(&reason)) GTEST_SKIP() << "a CUDA device is present; this checks its absence";
  Problem p = Problem::random(1, 7, 3, 1, 11);
  Buffers<float> b(p);
  // The message says why: the reason the device query gave.
  EXPECT_TRUE(throws_error([&] { attend(b.input, b.output, {Device::cuda}); },
                           ErrorCode::unsupported, {"cuda", reason}));
  EXPECT_EQ(resolve_device(Device::automatic), Device::cpu);
}

#if defined(EMFLOW_WITH_CUDA)

TEST(CudaWithoutDevice, AsyncApiReportsTheSameUnsupportedError) {
  std::string reason;
  if (cuda::device_available(&reason)) {
    GTEST_SKIP() << "a CUDA device is present; this checks its absence";
  }
  EXPECT_FALSE(reason.empty());
  Problem p = Problem::random(2, 33, 8, 2, 12);
  Buffers<float> b(p);
  const std::size_t bytes = cuda::attend_workspace_size(b.input, b.output);
  std::vector<unsigned char> not_a_device_workspace(1);
  EXPECT_TRUE(throws_error(
      [&] { cuda::attend_async(b.input, b.output, not_a_device_workspace.data(), bytes, nullptr); },
      ErrorCode::unsupported, {"attend_async", reason}));
}

// The runtime's own text for a machine without a driver is "CUDA driver version is insufficient
// for CUDA runtime version", the same as for a driver too old: the reason tells the two apart.
TEST(CudaWithoutDevice, TheReasonSaysWhetherADriverIsInstalled) {
  std::string reason;
  if (cuda::device_available(&reason)) {
    GTEST_SKIP() << "a CUDA device is present; this checks its absence";
  }
  int driver = -1;
  ASSERT_EQ(cudaDriverGetVersion(&driver), cudaSuccess);
  if (driver == 0) {
    EXPECT_NE(reason.find("no NVIDIA driver is installed"), std::string::npos) << reason;
  } else {
    EXPECT_EQ(reason.find("no NVIDIA driver"), std::string::npos) << reason;
  }
}

// ---------------------------------------------------------------------------------------------
// The workspace query needs no device.

TEST(CudaWorkspace, SizeFollowsAlgorithmAndOutputs) {
  Problem p = Problem::random(2, 100, 16, 3, 13);
  Buffers<float> plain(p);
  Buffers<float> with_weights(p, /*with_weights=*/true);
  const std::size_t fused =
      cuda::attend_workspace_size(plain.input, plain.output, {cuda::Algorithm::fused});
  const std::size_t unfused =
      cuda::attend_workspace_size(plain.input, plain.output, {cuda::Algorithm::unfused});
  const std::size_t unfused_weights = cuda::attend_workspace_size(
      with_weights.input, with_weights.output, {cuda::Algorithm::unfused});
  const std::size_t scores = 2 * 3 * 100 * 100 * sizeof(float);
  const std::size_t projections = 2 * 3 * 2 * 100 * 16 * sizeof(float);
  EXPECT_GE(fused, projections);
  // The unfused path keeps the scores in the workspace unless they go to `weights`.
  EXPECT_GE(unfused, unfused_weights + scores);
  EXPECT_EQ(cuda::attend_workspace_size(plain.input, plain.output), fused);
  EXPECT_EQ(cuda::attend_workspace_size(with_weights.input, with_weights.output), unfused_weights);
}

TEST(CudaWorkspace, FusedRefusesWhatItCannotCompute) {
  auto expect_unsupported = [](auto&& call, const char* needle) {
    EXPECT_TRUE(throws_error(call, ErrorCode::unsupported, {needle}));
  };
  Problem p = Problem::random(1, 10, 4, 1, 14);
  Buffers<float> with_weights(p, true);
  Buffers<double> in_double(p);
  Problem wide = Problem::random(1, 3, 300, 1, 15);
  Buffers<float> too_wide(wide);
  expect_unsupported(
      [&] {
        cuda::attend_workspace_size(with_weights.input, with_weights.output,
                                    {cuda::Algorithm::fused});
      },
      "weights");
  expect_unsupported(
      [&] {
        cuda::attend_workspace_size(in_double.input, in_double.output, {cuda::Algorithm::fused});
      },
      "float32 only");
  expect_unsupported(
      [&] {
        cuda::attend_workspace_size(too_wide.input, too_wide.output, {cuda::Algorithm::fused});
      },
      "dim <= 256");
  // Automatic falls back to the unfused path for each of them.
  EXPECT_GT(cuda::attend_workspace_size(too_wide.input, too_wide.output), 0u);
  Buffers<float> bad(p);
  bad.input.tokens = 0;
  EXPECT_THROW(cuda::attend_workspace_size(bad.input, bad.output), Error);
}

// ---------------------------------------------------------------------------------------------
// The stream-ordered API on a device.

// A small float problem on the device, with a stream and a workspace of the size it needs plus
// `extra` bytes.
struct OnDevice {
  Problem problem;
  Buffers<float> host;
  CudaStream s;
  DeviceProblem<float> device;
  std::size_t bytes;
  cuda::DeviceBuffer<unsigned char> workspace;

  explicit OnDevice(std::uint64_t seed, std::size_t extra = 0)
      : problem(Problem::random(1, 40, 16, 1, seed)),
        host(problem),
        device(host, s.stream),
        bytes(cuda::attend_workspace_size(device.input, device.output)),
        workspace(bytes + extra) {}
};

// Two problems enqueued back to back on one caller stream, sharing one workspace, with no
// synchronisation in between: stream order alone keeps them apart.
TEST(CudaAsync, BackToBackCallsShareStreamAndWorkspace) {
  EMFLOW_REQUIRE_CUDA();
  Problem p1 = Problem::random(2, 300, 64, 2, 51);
  Problem p2 = Problem::random(2, 300, 64, 2, 52);
  p1.mask = p2.mask = Mask::sliding_window(40);
  p1.key_bias = p2.key_bias = true;
  const reference::Attention ref1 = composed_reference(p1, false);
  const reference::Attention ref2 = composed_reference(p2, false);
  Buffers<float> got1(p1), got2(p2);
  CudaStream s;
  DeviceProblem<float> d1(got1, s.stream), d2(got2, s.stream);
  const std::size_t bytes = cuda::attend_workspace_size(d1.input, d1.output);
  ASSERT_EQ(bytes, cuda::attend_workspace_size(d2.input, d2.output));
  cuda::DeviceBuffer<unsigned char> workspace(bytes);
  cuda::attend_async(d1.input, d1.output, workspace.data(), bytes, s.stream);
  cuda::attend_async(d2.input, d2.output, workspace.data(), bytes, s.stream);
  d1.download(got1, s.stream);
  d2.download(got2, s.stream);
  ASSERT_EQ(cudaStreamSynchronize(s.stream), cudaSuccess);
  expect_matches(got1, ref1, 1e-5, "first call");
  expect_matches(got2, ref2, 1e-5, "second call");
}

TEST(CudaAsync, RejectsBadWorkspaceAndHostPointers) {
  EMFLOW_REQUIRE_CUDA();
  OnDevice on(61, 256);
  auto expect_invalid = [](auto&& call, const char* needle) {
    EXPECT_TRUE(throws_error(call, ErrorCode::invalid_argument, {needle}));
  };
  expect_invalid(
      [&] {
        cuda::attend_async(on.device.input, on.device.output, on.workspace.data(), on.bytes - 1,
                           on.s.stream);
      },
      "workspace_bytes");
  expect_invalid(
      [&] {
        cuda::attend_async(on.device.input, on.device.output, on.workspace.data() + 16, on.bytes,
                           on.s.stream);
      },
      "aligned");
  expect_invalid(
      [&] {
        cuda::attend_async(on.host.input, on.device.output, on.workspace.data(), on.bytes,
                           on.s.stream);
      },
      "cloud");
  ASSERT_EQ(cudaStreamSynchronize(on.s.stream), cudaSuccess);
}

TEST(CudaAsync, RejectsOutputsThatOverlapInputsOrTheWorkspace) {
  EMFLOW_REQUIRE_CUDA();
  OnDevice on(62);
  auto expect_overlap = [&](const AttentionOutput<float>& output, void* space, const char* a,
                            const char* b) {
    EXPECT_TRUE(throws_error(
        [&] { cuda::attend_async(on.device.input, output, space, on.bytes, on.s.stream); },
        ErrorCode::invalid_argument, {a, b}))
        << "an overlap of " << a << " and " << b;
  };
  AttentionOutput<float> in_place = on.device.output;
  in_place.update = const_cast<float*>(on.device.input.cloud);
  expect_overlap(in_place, on.workspace.data(), "update", "cloud");
  AttentionOutput<float> shared_statistics = on.device.output;
  shared_statistics.entropy = shared_statistics.lse + 1;
  expect_overlap(shared_statistics, on.workspace.data(), "entropy", "lse");
  // The workspace is written too: an output inside it is refused.
  cuda::DeviceBuffer<unsigned char> big(on.bytes + 4096);
  AttentionOutput<float> in_workspace = on.device.output;
  in_workspace.lse = reinterpret_cast<float*>(big.data() + on.bytes - 64);
  expect_overlap(in_workspace, big.data(), "lse", "workspace");
  ASSERT_EQ(cudaStreamSynchronize(on.s.stream), cudaSuccess);
}

TEST(CudaAsync, AnErrorPendingBeforeTheCallIsNamedAndLeftForTheCaller) {
  EMFLOW_REQUIRE_CUDA();
  OnDevice on(63);
  // A failed allocation records a (non-sticky) error as the thread's last error.
  void* impossible = nullptr;
  ASSERT_NE(cudaMalloc(&impossible, std::size_t{1} << 62), cudaSuccess);
  EXPECT_TRUE(throws_error(
      [&] {
        cuda::attend_async(on.device.input, on.device.output, on.workspace.data(), on.bytes,
                           on.s.stream);
      },
      ErrorCode::device, {"already pending"}));
  // Still there for its owner; once consumed, the same call runs and is right.
  EXPECT_NE(cudaGetLastError(), cudaSuccess);
  const reference::Attention ref = composed_reference(on.problem, false);
  cuda::attend_async(on.device.input, on.device.output, on.workspace.data(), on.bytes, on.s.stream);
  on.device.download(on.host, on.s.stream);
  ASSERT_EQ(cudaStreamSynchronize(on.s.stream), cudaSuccess);
  expect_matches(on.host, ref, 1e-5, "after the caller consumed its error");
}

#endif  // EMFLOW_WITH_CUDA

}  // namespace
}  // namespace emflow::testing
