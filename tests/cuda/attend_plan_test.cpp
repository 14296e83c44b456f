// The CUDA attention plan (src/cuda/attend_plan.hpp): made once, enqueued many times. Its size is
// attend_workspace_size's; two enqueues with different beta and pointers give what two
// attend_async calls give (bitwise: both run the same kernels) and what the reference gives; a
// call that does not match the plan is refused, naming what differs. The sizing tests run
// everywhere; the others skip without a device (the CPU emulation of CUDA runs them).
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "common/testing.hpp"
#include "emflow/attention.hpp"
#include "emflow/error.hpp"

#if defined(EMFLOW_WITH_CUDA)
#include <cuda_runtime.h>

#include "emflow/cuda.hpp"
#include "cuda/attend_plan.hpp"

namespace emflow::testing {
namespace {

using cuda::Algorithm;
using detail::AttentionPlan;

void expect_error(ErrorCode code, const std::string& needle, const std::function<void()>& call) {
  EXPECT_TRUE(throws_error(call, code, {needle}));
}

TEST(AttentionPlanSize, WorkspaceBytesIsAttendWorkspaceSize) {
  Problem p = Problem::random(2, 70, 24, 3, 81);
  p.mask = Mask::sliding_window(9);
  const Buffers<float> plain(p), with_weights(p, true);
  const Buffers<double> in_double(p);
  struct Config {
    const char* name;
    const AttentionInput<float>* input;
    const AttentionOutput<float>* output;
    Algorithm requested, chosen;
  };
  const Config configs[] = {
      {"automatic", &plain.input, &plain.output, Algorithm::automatic, Algorithm::fused},
      {"fused", &plain.input, &plain.output, Algorithm::fused, Algorithm::fused},
      {"unfused", &plain.input, &plain.output, Algorithm::unfused, Algorithm::unfused},
      {"weights", &with_weights.input, &with_weights.output, Algorithm::automatic,
       Algorithm::unfused},
  };
  std::vector<std::size_t> sizes;
  for (const Config& c : configs) {
    const AttentionPlan<float> plan(*c.input, *c.output, c.requested, "test", false);
    EXPECT_EQ(plan.workspace_bytes(), cuda::attend_workspace_size(*c.input, *c.output, c.requested))
        << c.name;
    EXPECT_EQ(plan.algorithm(), c.chosen) << c.name;
    sizes.push_back(plan.workspace_bytes());
  }
  // Not one size for all: the unfused path holds the scores unless they go to `weights`.
  EXPECT_GT(sizes[2], sizes[1]);
  EXPECT_LT(sizes[3], sizes[2]);
  const AttentionPlan<double> plan(in_double.input, in_double.output, Algorithm::automatic, "test",
                                   false);
  EXPECT_EQ(plan.algorithm(), Algorithm::unfused);
  EXPECT_EQ(plan.workspace_bytes(), cuda::attend_workspace_size(in_double.input, in_double.output));
}

TEST(AttentionPlanSize, PlanChecksWhatTheAsyncCallChecks) {
  Problem p = Problem::random(1, 9, 4, 1, 82);
  Buffers<float> b(p);
  b.input.mask = Mask::sliding_window(0);
  expect_error(ErrorCode::invalid_argument, "mask", [&] {
    AttentionPlan<float>(b.input, b.output, Algorithm::automatic, "test", false);
  });
  b.input.mask = Mask::none();
  b.input.tokens = 0;
  expect_error(ErrorCode::invalid_argument, "tokens", [&] {
    AttentionPlan<float>(b.input, b.output, Algorithm::automatic, "test", false);
  });
  Buffers<double> d(p);
  expect_error(ErrorCode::unsupported, "float only",
               [&] { AttentionPlan<double>(d.input, d.output, Algorithm::fused, "test", false); });
}

TEST(AttentionPlanSize, APlanForSizingIsNotEnqueued) {
  Problem p = Problem::random(1, 9, 4, 1, 83);
  Buffers<float> b(p);
  const AttentionPlan<float> plan(b.input, b.output, Algorithm::automatic, "test", false);
  // Refused before anything is read or launched, so host pointers are harmless here.
  expect_error(ErrorCode::invalid_argument, "query_device",
               [&] { plan.enqueue(b.input, b.output, nullptr, nullptr); });
}

// ---------------------------------------------------------------------------------------------
// On a device (or the emulation).

struct Stream {
  cudaStream_t handle = nullptr;
  Stream() { EXPECT_EQ(cudaStreamCreateWithFlags(&handle, cudaStreamNonBlocking), cudaSuccess); }
  ~Stream() {
    if (handle != nullptr) cudaStreamDestroy(handle);
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
};

// One problem's arrays on the device (no offset: the plan tests do not need every input).
template <class T>
struct OnDevice {
  cuda::DeviceBuffer<T> cloud, relevance, content, bias, update, lse, entropy;
  cuda::DeviceBuffer<std::int64_t> lengths;
  AttentionInput<T> input;
  AttentionOutput<T> output;

  OnDevice(const Buffers<T>& host, cudaStream_t stream)
      : cloud(host.cloud.size()),
        relevance(host.relevance.size()),
        content(host.content.size()),
        bias(host.bias.size()),
        update(host.update.size()),
        lse(host.lse.size()),
        entropy(host.entropy.size()),
        lengths(host.key_lengths.size()) {
    cloud.copy_from_host(host.cloud.data(), cloud.size(), stream);
    relevance.copy_from_host(host.relevance.data(), relevance.size(), stream);
    content.copy_from_host(host.content.data(), content.size(), stream);
    bias.copy_from_host(host.bias.data(), bias.size(), stream);
    lengths.copy_from_host(host.key_lengths.data(), lengths.size(), stream);
    input = host.input;
    input.cloud = cloud.data();
    input.layer.relevance = relevance.data();
    input.layer.content = content.data();
    input.layer.key_bias = host.input.layer.key_bias ? bias.data() : nullptr;
    input.key_lengths = host.input.key_lengths ? lengths.data() : nullptr;
    output.update = update.data();
    output.lse = lse.data();
    output.entropy = entropy.data();
  }

  void download(Buffers<T>& host, cudaStream_t stream) const {
    update.copy_to_host(host.update.data(), update.size(), stream);
    lse.copy_to_host(host.lse.data(), lse.size(), stream);
    entropy.copy_to_host(host.entropy.data(), entropy.size(), stream);
  }
};

// Two clouds of the same shapes with different beta: one plan enqueued twice on one stream and
// workspace, against two attend_async calls, and both against the reference.
template <class T>
void enqueue_twice_matches_attend_async(Algorithm algorithm, std::int64_t dim) {
  Problem first = Problem::random(2, 21, dim, 2, 84);
  Problem second = Problem::random(2, 21, dim, 2, 85);
  for (Problem* p : {&first, &second}) {
    p->mask = Mask::causal();
    p->key_bias = true;
    p->key_lengths = {21, 12};
  }
  first.beta = 0.7;
  second.beta = 1.4;
  Stream s;
  Buffers<T> planned_first(first), planned_second(second);
  Buffers<T> async_first(first), async_second(second);
  OnDevice<T> d1(planned_first, s.handle), d2(planned_second, s.handle);
  OnDevice<T> a1(async_first, s.handle), a2(async_second, s.handle);

  const AttentionPlan<T> plan(d1.input, d1.output, algorithm, "attend_plan_test");
  cuda::DeviceBuffer<unsigned char> workspace(plan.workspace_bytes());
  plan.enqueue(d1.input, d1.output, workspace.data(), s.handle);
  plan.enqueue(d2.input, d2.output, workspace.data(), s.handle);
  cuda::attend_async(a1.input, a1.output, workspace.data(), workspace.size(), s.handle, algorithm);
  cuda::attend_async(a2.input, a2.output, workspace.data(), workspace.size(), s.handle, algorithm);
  d1.download(planned_first, s.handle);
  d2.download(planned_second, s.handle);
  a1.download(async_first, s.handle);
  a2.download(async_second, s.handle);
  ASSERT_EQ(cudaStreamSynchronize(s.handle), cudaSuccess);

  EXPECT_EQ(planned_first.update, async_first.update);
  EXPECT_EQ(planned_first.lse, async_first.lse);
  EXPECT_EQ(planned_second.update, async_second.update);
  EXPECT_EQ(planned_second.entropy, async_second.entropy);
  const double tolerance = sizeof(T) == sizeof(float) ? 1e-5 : 1e-12;
  for (const auto& [problem, got] :
       {std::pair<const Problem*, const Buffers<T>*>{&first, &planned_first},
        std::pair<const Problem*, const Buffers<T>*>{&second, &planned_second}}) {
    Buffers<double> ref(*problem);
    attend(ref.input, ref.output, {Device::reference});
    ASSERT_GT(relative_error(std::vector<double>(ref.update.size(), 0.0), ref.update), 0.0);
    EXPECT_LT(relative_error(got->update, ref.update), tolerance) << "beta " << problem->beta;
    EXPECT_LT(relative_error(got->lse, ref.lse), tolerance) << "beta " << problem->beta;
  }
  // The two betas give two different updates: the second enqueue did not reuse the first's.
  EXPECT_GT(relative_error(planned_first.update, planned_second.update), 1e-3);
}

TEST(AttentionPlan, EnqueueTwiceEqualsTwoAsyncCallsFused) {
  EMFLOW_REQUIRE_CUDA();
  enqueue_twice_matches_attend_async<float>(Algorithm::fused, 12);
}

TEST(AttentionPlan, EnqueueTwiceEqualsTwoAsyncCallsUnfused) {
  EMFLOW_REQUIRE_CUDA();
  enqueue_twice_matches_attend_async<float>(Algorithm::unfused, 12);
}

TEST(AttentionPlan, EnqueueTwiceEqualsTwoAsyncCallsDouble) {
  EMFLOW_REQUIRE_CUDA();
  enqueue_twice_matches_attend_async<double>(Algorithm::unfused, 8);
}

TEST(AttentionPlan, ACallThatDoesNotMatchThePlanIsRefused) {
  EMFLOW_REQUIRE_CUDA();
  Problem p = Problem::random(1, 20, 8, 2, 86);
  p.mask = Mask::sliding_window(5);
  Stream s;
  Buffers<float> host(p);
  OnDevice<float> device(host, s.handle);
  const AttentionPlan<float> plan(device.input, device.output, Algorithm::automatic, "plan_test");
  cuda::DeviceBuffer<unsigned char> workspace(plan.workspace_bytes());
  const auto refused = [&](const AttentionInput<float>& input, const AttentionOutput<float>& output,
                           const char* needle) {
    expect_error(ErrorCode::invalid_argument, needle,
                 [&] { plan.enqueue(input, output, workspace.data(), s.handle); });
  };
  AttentionInput<float> fewer_tokens = device.input;
  fewer_tokens.tokens = 19;
  refused(fewer_tokens, device.output, "argument 'tokens' is 19, but the plan was made for 20");
  AttentionInput<float> more_heads = device.input;
  more_heads.layer.heads = 3;
  refused(more_heads, device.output, "argument 'heads' is 3");
  AttentionInput<float> wider_window = device.input;
  wider_window.mask = Mask::sliding_window(6);
  refused(wider_window, device.output, "is window:6, but the plan was made for window:5");
  AttentionInput<float> causal = device.input;
  causal.mask = Mask::causal();
  refused(causal, device.output, "mask");
  AttentionOutput<float> without_lse = device.output;
  without_lse.lse = nullptr;
  refused(device.input, without_lse, "argument 'lse' is null, but the plan was made with it given");
  AttentionOutput<float> without_update = device.output;
  without_update.update = nullptr;
  refused(device.input, without_update, "update");
  // The matching call still runs, and is right.
  plan.enqueue(device.input, device.output, workspace.data(), s.handle);
  device.download(host, s.handle);
  ASSERT_EQ(cudaStreamSynchronize(s.handle), cudaSuccess);
  Buffers<double> ref(p);
  attend(ref.input, ref.output, {Device::reference});
  EXPECT_LT(relative_error(host.update, ref.update), 1e-5);
}

}  // namespace
}  // namespace emflow::testing

#endif  // EMFLOW_WITH_CUDA
