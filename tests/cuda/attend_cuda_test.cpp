// The CUDA backend held against the double reference: both algorithms, every mask, key lengths,
// key bias, offset, several heads and clouds, awkward sizes, weights, determinism, and the
// stream-ordered API with a caller's stream and workspace. Every GPU test starts with
// EMFLOW_REQUIRE_CUDA() and skips without a device; the tests of the error path without a device
// and of the workspace query run everywhere.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <ostream>
#include <string>
#include <vector>

#include "common/testing.hpp"
#include "emflow/attention.hpp"
#include "emflow/error.hpp"

#if defined(EMFLOW_WITH_CUDA)
#include <cuda_runtime.h>

#include "emflow/cuda.hpp"
#endif

namespace emflow::testing {
namespace {

// The accuracy contract (REFERENCE.md §6): fp32 well under 1e-5 against the double reference.
constexpr double kFloatTolerance = 1e-5;
constexpr double kDoubleTolerance = 1e-12;

template <class T>
double tolerance() {
  return sizeof(T) == sizeof(float) ? kFloatTolerance : kDoubleTolerance;
}

// Key lengths that exercise a full cloud, an empty one (every query fully masked) and a partial
// one, in turn.
std::vector<std::int64_t> mixed_lengths(std::int64_t batch, std::int64_t tokens) {
  std::vector<std::int64_t> lengths(static_cast<std::size_t>(batch));
  for (std::int64_t b = 0; b < batch; ++b) {
    const std::int64_t kind = b % 3;
    lengths[static_cast<std::size_t>(b)] =
        kind == 0 ? std::max<std::int64_t>(1, tokens - tokens / 3) : (kind == 1 ? tokens : 0);
  }
  return lengths;
}

Buffers<double> reference_of(const Problem& p, bool weights) {
  Buffers<double> ref(p, weights);
  attend(ref.input, ref.output, {Device::reference});
  return ref;
}

// Every output the GPU wrote agrees with the reference; nothing is NaN (outputs were poisoned).
template <class T>
void expect_matches(const Buffers<T>& got, const Buffers<double>& ref, const std::string& what) {
  const double norm = relative_error(std::vector<double>(ref.update.size(), 0.0), ref.update);
  ASSERT_GT(norm, 0.0) << what << ": the reference update is all zeros; the test would be vacuous";
  EXPECT_TRUE(all_finite_or_neg_inf(got.update)) << what;
  EXPECT_LT(relative_error(got.update, ref.update), tolerance<T>()) << what << ": update";
  if (!ref.lse.empty()) {
    EXPECT_TRUE(all_finite_or_neg_inf(got.lse)) << what;
    EXPECT_TRUE(all_finite_or_neg_inf(got.entropy)) << what;
    EXPECT_LT(relative_error(got.lse, ref.lse), tolerance<T>()) << what << ": lse";
    EXPECT_LT(relative_error(got.entropy, ref.entropy), tolerance<T>()) << what << ": entropy";
  }
  if (!ref.weights.empty()) {
    EXPECT_TRUE(all_finite_or_neg_inf(got.weights)) << what;
    EXPECT_LT(relative_error(got.weights, ref.weights), tolerance<T>()) << what << ": weights";
  }
}

// Fully masked queries (beyond their cloud's key length): zero update, lse -inf, entropy 0.
template <class T>
void expect_padding_rows(const Buffers<T>& got, const Problem& p) {
  if (p.key_lengths.empty()) return;
  for (std::int64_t b = 0; b < p.batch; ++b) {
    const std::int64_t length = p.key_lengths[static_cast<std::size_t>(b)];
    for (std::int64_t i = length; i < p.tokens; ++i) {
      for (std::int64_t a = 0; a < p.dim; ++a) {
        ASSERT_EQ(got.update[static_cast<std::size_t>((b * p.tokens + i) * p.dim + a)], T(0))
            << "cloud " << b << " query " << i;
      }
      for (std::int64_t h = 0; h < p.heads; ++h) {
        const auto row = static_cast<std::size_t>((b * p.heads + h) * p.tokens + i);
        if (!got.lse.empty()) {
          ASSERT_EQ(got.lse[row], -std::numeric_limits<T>::infinity());
          ASSERT_EQ(got.entropy[row], T(0));
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Without a device (this runs on every machine; it skips where a device is present).

TEST(CudaWithoutDevice, AttendOnCudaIsAClearUnsupportedError) {
  std::string reason;
  if (cuda_available(&reason)) GTEST_SKIP() << "a CUDA device is present; this checks its absence";
  Problem p = Problem::random(1, 7, 3, 1, 11);
  Buffers<float> b(p);
  try {
    attend(b.input, b.output, {Device::cuda});
    FAIL() << "attend on Device::cuda without a device did not throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::unsupported) << e.what();
    EXPECT_NE(std::string(e.what()).find("cuda"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(reason), std::string::npos)
        << "the message should say why: " << e.what();
  }
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
  try {
    cuda::attend_async(b.input, b.output, not_a_device_workspace.data(), bytes, nullptr);
    FAIL() << "attend_async without a device did not throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::unsupported) << e.what();
    EXPECT_NE(std::string(e.what()).find("attend_async"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(reason), std::string::npos) << e.what();
  }
}

// ---------------------------------------------------------------------------------------------
// The workspace query needs no device.

TEST(CudaWorkspace, SizeFollowsAlgorithmAndOutputs) {
  Problem p = Problem::random(2, 100, 16, 3, 13);
  Buffers<float> plain(p);
  Buffers<float> with_weights(p, /*with_weights=*/true);
  const std::size_t fused =
      cuda::attend_workspace_size(plain.input, plain.output, cuda::Algorithm::fused);
  const std::size_t unfused =
      cuda::attend_workspace_size(plain.input, plain.output, cuda::Algorithm::unfused);
  const std::size_t unfused_weights = cuda::attend_workspace_size(
      with_weights.input, with_weights.output, cuda::Algorithm::unfused);
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
    try {
      call();
      ADD_FAILURE() << "expected an unsupported error mentioning '" << needle << "'";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::unsupported) << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  Problem p = Problem::random(1, 10, 4, 1, 14);
  Buffers<float> with_weights(p, true);
  Buffers<double> in_double(p);
  Problem wide = Problem::random(1, 3, 300, 1, 15);
  Buffers<float> too_wide(wide);
  expect_unsupported(
      [&] {
        cuda::attend_workspace_size(with_weights.input, with_weights.output,
                                    cuda::Algorithm::fused);
      },
      "weights");
  expect_unsupported(
      [&] {
        cuda::attend_workspace_size(in_double.input, in_double.output, cuda::Algorithm::fused);
      },
      "float only");
  expect_unsupported(
      [&] { cuda::attend_workspace_size(too_wide.input, too_wide.output, cuda::Algorithm::fused); },
      "dim <= 256");
  // Automatic falls back to the unfused path for each of them.
  EXPECT_GT(cuda::attend_workspace_size(too_wide.input, too_wide.output), 0u);
  Buffers<float> bad(p);
  bad.input.tokens = 0;
  EXPECT_THROW(cuda::attend_workspace_size(bad.input, bad.output), Error);
}

// ---------------------------------------------------------------------------------------------
// GPU against the reference.

struct CudaStream {
  cudaStream_t stream = nullptr;
  CudaStream() {
    EXPECT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  }
  ~CudaStream() {
    if (stream != nullptr) cudaStreamDestroy(stream);
  }
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;
};

// The host problem's arrays on the device, with device-side AttentionInput/Output.
template <class T>
struct DeviceProblem {
  cuda::DeviceBuffer<T> cloud, relevance, content, bias, shift, update, lse, entropy, weights;
  cuda::DeviceBuffer<std::int64_t> lengths;
  AttentionInput<T> input;
  AttentionOutput<T> output;

  DeviceProblem(const Buffers<T>& host, cudaStream_t stream)
      : cloud(host.cloud.size()),
        relevance(host.relevance.size()),
        content(host.content.size()),
        bias(host.bias.size()),
        shift(host.shift.size()),
        update(host.update.size()),
        lse(host.lse.size()),
        entropy(host.entropy.size()),
        weights(host.weights.size()),
        lengths(host.input.key_lengths ? static_cast<std::size_t>(host.input.batch) : 0) {
    cloud.copy_from_host(host.cloud.data(), host.cloud.size(), stream);
    relevance.copy_from_host(host.relevance.data(), host.relevance.size(), stream);
    content.copy_from_host(host.content.data(), host.content.size(), stream);
    bias.copy_from_host(host.bias.data(), host.bias.size(), stream);
    shift.copy_from_host(host.shift.data(), host.shift.size(), stream);
    // Poison the outputs on the device too: NaN bit patterns copied from the host buffers.
    update.copy_from_host(host.update.data(), host.update.size(), stream);
    lse.copy_from_host(host.lse.data(), host.lse.size(), stream);
    entropy.copy_from_host(host.entropy.data(), host.entropy.size(), stream);
    weights.copy_from_host(host.weights.data(), host.weights.size(), stream);
    if (host.input.key_lengths) {
      lengths.copy_from_host(host.input.key_lengths, lengths.size(), stream);
    }
    input = host.input;
    input.cloud = cloud.data();
    input.layer.relevance = relevance.data();
    input.layer.content = content.data();
    input.layer.key_bias = host.input.layer.key_bias ? bias.data() : nullptr;
    input.layer.offset = host.input.layer.offset ? shift.data() : nullptr;
    input.key_lengths = host.input.key_lengths ? lengths.data() : nullptr;
    output.update = update.data();
    output.lse = host.output.lse ? lse.data() : nullptr;
    output.entropy = host.output.entropy ? entropy.data() : nullptr;
    output.weights = host.output.weights ? weights.data() : nullptr;
  }

  void download(Buffers<T>& host, cudaStream_t stream) const {
    update.copy_to_host(host.update.data(), host.update.size(), stream);
    lse.copy_to_host(host.lse.data(), host.lse.size(), stream);
    entropy.copy_to_host(host.entropy.data(), host.entropy.size(), stream);
    weights.copy_to_host(host.weights.data(), host.weights.size(), stream);
  }
};

// Runs one problem through attend_async on a caller's stream with a caller's workspace.
template <class T>
void run_async(Buffers<T>& host, cuda::Algorithm algorithm) {
  CudaStream s;
  DeviceProblem<T> device(host, s.stream);
  const std::size_t bytes = cuda::attend_workspace_size(device.input, device.output, algorithm);
  cuda::DeviceBuffer<unsigned char> workspace(bytes);
  cuda::attend_async(device.input, device.output, workspace.data(), bytes, s.stream, algorithm);
  device.download(host, s.stream);
  ASSERT_EQ(cudaStreamSynchronize(s.stream), cudaSuccess);
}

struct Case {
  const char* name;
  std::int64_t batch, tokens, dim, heads;
  Mask mask;
  bool lengths, bias, offset, weights;
  cuda::Algorithm algorithm;
  double beta;
};

std::ostream& operator<<(std::ostream& out, const Case& c) { return out << c.name; }

Problem problem_of(const Case& c, std::uint64_t seed) {
  Problem p = Problem::random(c.batch, c.tokens, c.dim, c.heads, seed);
  p.mask = c.mask;
  p.key_bias = c.bias;
  p.offset = c.offset;
  p.beta = c.beta;
  if (c.lengths) p.key_lengths = mixed_lengths(c.batch, c.tokens);
  return p;
}

using A = cuda::Algorithm;
const Mask kNone = Mask::none();
const Mask kCausal = Mask::causal();

class CudaFloat : public ::testing::TestWithParam<Case> {};
class CudaDouble : public ::testing::TestWithParam<Case> {};

TEST_P(CudaFloat, MatchesReference) {
  EMFLOW_REQUIRE_CUDA();
  const Case& c = GetParam();
  const Problem p = problem_of(c, 100 + static_cast<std::uint64_t>(c.tokens * 7 + c.dim));
  const Buffers<double> ref = reference_of(p, c.weights);
  Buffers<float> got(p, c.weights);
  run_async(got, c.algorithm);
  expect_matches(got, ref, c.name);
  expect_padding_rows(got, p);
}

TEST_P(CudaDouble, MatchesReference) {
  EMFLOW_REQUIRE_CUDA();
  const Case& c = GetParam();
  const Problem p = problem_of(c, 200 + static_cast<std::uint64_t>(c.tokens * 7 + c.dim));
  const Buffers<double> ref = reference_of(p, c.weights);
  Buffers<double> got(p, c.weights);
  run_async(got, c.algorithm);
  expect_matches(got, ref, c.name);
  expect_padding_rows(got, p);
}

// clang-format off
INSTANTIATE_TEST_SUITE_P(Fused, CudaFloat, ::testing::Values(
    Case{"n1_d1", 1, 1, 1, 1, kNone, false, false, false, false, A::fused, 1.0},
    Case{"n7_d3_causal_bias_offset_2heads", 2, 7, 3, 2, kCausal, false, true, true, false, A::fused, 1.0},
    Case{"n33_d64_window5_lengths_3heads", 3, 33, 64, 3, Mask::sliding_window(5), true, true, true, false, A::fused, 0.7},
    Case{"n101_d128_causal_lengths", 3, 101, 128, 2, kCausal, true, true, true, false, A::fused, 1.0},
    Case{"n101_d1_lengths", 3, 101, 1, 2, kNone, true, false, true, false, A::fused, 1.0},
    Case{"n200_d16_window5_lengths", 2, 200, 16, 2, Mask::sliding_window(5), true, true, true, false, A::fused, 1.0},
    Case{"n300_d130_window70", 1, 300, 130, 1, Mask::sliding_window(70), false, true, true, false, A::fused, 1.0},
    Case{"n33_d255_causal_4heads", 1, 33, 255, 4, kCausal, false, true, false, false, A::fused, 1.0},
    Case{"n1000_d255_bias_offset", 1, 1000, 255, 1, kNone, false, true, true, false, A::fused, 1.0},
    Case{"n1000_d128_window300_lengths", 2, 1000, 128, 2, Mask::sliding_window(300), true, true, true, false, A::fused, 1.3},
    Case{"n4097_d64_causal", 1, 4097, 64, 1, kCausal, false, false, true, false, A::fused, 1.0},
    Case{"n4097_d3_window1000", 1, 4097, 3, 1, Mask::sliding_window(1000), false, true, true, false, A::fused, 1.0},
    Case{"n1000_d64_window1", 1, 1000, 64, 1, Mask::sliding_window(1), false, false, true, false, A::fused, 1.0}),
    [](const auto& info) { return std::string(info.param.name); });

INSTANTIATE_TEST_SUITE_P(Unfused, CudaFloat, ::testing::Values(
    Case{"n1_d1", 1, 1, 1, 1, kNone, false, false, false, true, A::unfused, 1.0},
    Case{"n7_d3_causal_lengths_weights", 2, 7, 3, 2, kCausal, true, true, true, true, A::unfused, 1.0},
    Case{"n33_d64_causal_lengths_weights_3heads", 3, 33, 64, 3, kCausal, true, false, true, true, A::unfused, 1.0},
    Case{"n101_d128_window17_lengths", 2, 101, 128, 2, Mask::sliding_window(17), true, true, true, false, A::unfused, 0.7},
    Case{"n1000_d255_weights", 1, 1000, 255, 1, kNone, false, true, true, true, A::unfused, 1.0},
    Case{"n4097_d64_causal", 1, 4097, 64, 1, kCausal, false, true, true, false, A::unfused, 1.0}),
    [](const auto& info) { return std::string(info.param.name); });

INSTANTIATE_TEST_SUITE_P(Unfused, CudaDouble, ::testing::Values(
    Case{"n7_d3_window2", 2, 7, 3, 2, Mask::sliding_window(2), false, true, true, true, A::automatic, 1.0},
    Case{"n101_d64_causal_lengths_weights", 3, 101, 64, 2, kCausal, true, true, true, true, A::unfused, 1.0},
    Case{"n1000_d3_window50", 1, 1000, 3, 1, Mask::sliding_window(50), false, true, true, false, A::automatic, 1.0}),
    [](const auto& info) { return std::string(info.param.name); });
// clang-format on

// The blocking form behind emflow::attend: host arrays in and out, automatic algorithm.
// Padding tokens (j >= L_b) may hold anything, even NaN: both algorithms must give what the
// reference gives, which never reads them (0 * NaN in P C would otherwise spread NaN).
TEST(CudaPadding, NaNInPaddingTokensChangesNothing) {
  EMFLOW_REQUIRE_CUDA();
  for (const A algorithm : {A::fused, A::unfused}) {
    Problem p = Problem::random(2, 101, 64, 2, 77);
    p.key_lengths = {37, 101};  // cloud 0's padding starts inside a 64-key tile
    p.key_bias = p.offset = true;
    const Buffers<double> ref = reference_of(p, false);
    for (std::int64_t j = 37; j < p.tokens; ++j) {
      for (std::int64_t a = 0; a < p.dim; ++a) {
        p.cloud[static_cast<std::size_t>(j * p.dim + a)] = std::numeric_limits<double>::quiet_NaN();
      }
    }
    Buffers<float> got(p, false);
    run_async(got, algorithm);
    const std::string what = algorithm == A::fused ? "fused" : "unfused";
    expect_matches(got, ref, what);
    expect_padding_rows(got, p);
  }
}

TEST(CudaBlocking, AttendOnCudaMatchesReference) {
  EMFLOW_REQUIRE_CUDA();
  Problem p = Problem::random(3, 257, 64, 2, 31);
  p.mask = Mask::causal();
  p.key_bias = true;
  p.offset = true;
  p.key_lengths = mixed_lengths(3, 257);
  const Buffers<double> ref = reference_of(p, false);
  Buffers<float> fused(p);
  attend(fused.input, fused.output, {Device::cuda});
  expect_matches(fused, ref, "blocking float (fused)");
  expect_padding_rows(fused, p);

  const Buffers<double> ref_weights = reference_of(p, true);
  Buffers<float> unfused(p, true);
  attend(unfused.input, unfused.output, {Device::cuda});
  expect_matches(unfused, ref_weights, "blocking float with weights (unfused)");

  Buffers<double> in_double(p, true);
  attend(in_double.input, in_double.output, {Device::cuda});
  expect_matches(in_double, ref_weights, "blocking double");
}

TEST(CudaBlocking, StatisticsAreOptional) {
  EMFLOW_REQUIRE_CUDA();
  Problem p = Problem::random(2, 65, 32, 3, 32);
  const Buffers<double> ref = reference_of(p, false);
  Buffers<float> got(p, false, /*with_stats=*/false);
  attend(got.input, got.output, {Device::cuda});
  EXPECT_LT(relative_error(got.update, ref.update), kFloatTolerance);
}

// Bitwise identical output for identical input, run to run, for both algorithms.
TEST(CudaDeterminism, TwoRunsAreBitwiseEqual) {
  EMFLOW_REQUIRE_CUDA();
  Problem p = Problem::random(2, 1000, 128, 3, 41);
  p.mask = Mask::causal();
  p.key_bias = true;
  p.offset = true;
  p.key_lengths = {1000, 613};
  for (const A algorithm : {A::fused, A::unfused}) {
    Buffers<float> first(p), second(p);
    run_async(first, algorithm);
    run_async(second, algorithm);
    const char* name = algorithm == A::fused ? "fused" : "unfused";
    EXPECT_EQ(
        std::memcmp(first.update.data(), second.update.data(), first.update.size() * sizeof(float)),
        0)
        << name;
    EXPECT_EQ(std::memcmp(first.lse.data(), second.lse.data(), first.lse.size() * sizeof(float)), 0)
        << name;
    EXPECT_EQ(std::memcmp(first.entropy.data(), second.entropy.data(),
                          first.entropy.size() * sizeof(float)),
              0)
        << name;
  }
}

// Two problems enqueued back to back on one caller stream, sharing one workspace, with no
// synchronisation in between: stream order alone keeps them apart.
TEST(CudaAsync, BackToBackCallsShareStreamAndWorkspace) {
  EMFLOW_REQUIRE_CUDA();
  Problem p1 = Problem::random(2, 300, 64, 2, 51);
  Problem p2 = Problem::random(2, 300, 64, 2, 52);
  p1.mask = p2.mask = Mask::sliding_window(40);
  p1.key_bias = p2.key_bias = true;
  const Buffers<double> ref1 = reference_of(p1, false), ref2 = reference_of(p2, false);
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
  expect_matches(got1, ref1, "first call");
  expect_matches(got2, ref2, "second call");
}

TEST(CudaAsync, RejectsBadWorkspaceAndHostPointers) {
  EMFLOW_REQUIRE_CUDA();
  Problem p = Problem::random(1, 40, 16, 1, 61);
  Buffers<float> host(p);
  CudaStream s;
  DeviceProblem<float> device(host, s.stream);
  const std::size_t bytes = cuda::attend_workspace_size(device.input, device.output);
  cuda::DeviceBuffer<unsigned char> workspace(bytes + 256);
  auto expect_invalid = [&](auto&& call, const char* needle) {
    try {
      call();
      ADD_FAILURE() << "expected an invalid_argument error mentioning '" << needle << "'";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_invalid(
      [&] {
        cuda::attend_async(device.input, device.output, workspace.data(), bytes - 1, s.stream);
      },
      "workspace_bytes");
  expect_invalid(
      [&] {
        cuda::attend_async(device.input, device.output, workspace.data() + 16, bytes, s.stream);
      },
      "aligned");
  expect_invalid(
      [&] { cuda::attend_async(host.input, device.output, workspace.data(), bytes, s.stream); },
      "cloud");
  ASSERT_EQ(cudaStreamSynchronize(s.stream), cudaSuccess);
}

TEST(CudaAsync, RejectsOutputsThatOverlapInputsOrTheWorkspace) {
  EMFLOW_REQUIRE_CUDA();
  Problem p = Problem::random(1, 40, 16, 1, 62);
  Buffers<float> host(p);
  CudaStream s;
  DeviceProblem<float> device(host, s.stream);
  const std::size_t bytes = cuda::attend_workspace_size(device.input, device.output);
  cuda::DeviceBuffer<unsigned char> workspace(bytes);
  auto expect_overlap = [&](const AttentionOutput<float>& output, void* space, const char* a,
                            const char* b) {
    try {
      cuda::attend_async(device.input, output, space, bytes, s.stream);
      ADD_FAILURE() << "expected an overlap of " << a << " and " << b << " to be refused";
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << what;
      EXPECT_NE(what.find(a), std::string::npos) << what;
      EXPECT_NE(what.find(b), std::string::npos) << what;
    }
  };
  AttentionOutput<float> in_place = device.output;
  in_place.update = const_cast<float*>(device.input.cloud);
  expect_overlap(in_place, workspace.data(), "update", "cloud");
  AttentionOutput<float> shared_statistics = device.output;
  shared_statistics.entropy = shared_statistics.lse + 1;
  expect_overlap(shared_statistics, workspace.data(), "entropy", "lse");
  // The workspace is written too: an output inside it is refused.
  cuda::DeviceBuffer<unsigned char> big(bytes + 4096);
  AttentionOutput<float> in_workspace = device.output;
  in_workspace.lse = reinterpret_cast<float*>(big.data() + bytes - 64);
  expect_overlap(in_workspace, big.data(), "lse", "workspace");
  ASSERT_EQ(cudaStreamSynchronize(s.stream), cudaSuccess);
}

TEST(CudaAsync, AnErrorPendingBeforeTheCallIsNamedAndLeftForTheCaller) {
  EMFLOW_REQUIRE_CUDA();
  Problem p = Problem::random(1, 40, 16, 1, 63);
  Buffers<float> host(p);
  CudaStream s;
  DeviceProblem<float> device(host, s.stream);
  const std::size_t bytes = cuda::attend_workspace_size(device.input, device.output);
  cuda::DeviceBuffer<unsigned char> workspace(bytes);
  // A failed allocation records a (non-sticky) error as the thread's last error.
  void* impossible = nullptr;
  ASSERT_NE(cudaMalloc(&impossible, std::size_t{1} << 62), cudaSuccess);
  try {
    cuda::attend_async(device.input, device.output, workspace.data(), bytes, s.stream);
    ADD_FAILURE() << "a pending error was not reported";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::device) << e.what();
    EXPECT_NE(std::string(e.what()).find("already pending"), std::string::npos) << e.what();
  }
  // Still there for its owner; once consumed, the same call runs and is right.
  EXPECT_NE(cudaGetLastError(), cudaSuccess);
  const Buffers<double> ref = reference_of(p, false);
  cuda::attend_async(device.input, device.output, workspace.data(), bytes, s.stream);
  device.download(host, s.stream);
  ASSERT_EQ(cudaStreamSynchronize(s.stream), cudaSuccess);
  expect_matches(host, ref, "after the caller consumed its error");
}

#endif  // EMFLOW_WITH_CUDA

}  // namespace
}  // namespace emflow::testing
