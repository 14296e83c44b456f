// The tensor-core attention kernel (kernels/tc_attention.cu) on bfloat16 and float16 inputs, at
// awkward sizes (N = 1, 17, 130; dims that leave part of a 16-wide step or of the tile empty),
// every mask, key lengths, key bias and lse. The accuracy rule (issue 16): against the double
// attention of the same rounded inputs, the kernel's error is at most twice the error of a naive
// implementation in the same precision (float scores, softmax and sums, the probabilities
// rounded to the 16-bit type before the product with V), plus 1e-6 for cases both compute
// exactly. Outputs are poisoned (NaN) before each call. Skipped without a device;
// tests/cuda/emulation runs them on the CPU (the model of mma.sync in kernels/mma.cuh).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "common/testing.hpp"
#include "emflow/precision.hpp"
#include "emflow/types.hpp"

#if defined(EMFLOW_WITH_CUDA)
#include <cuda_runtime.h>

#include "emflow/cuda.hpp"
#include "kernels/tc_attention.hpp"
#include "tc_reference.hpp"

namespace emflow::testing {
namespace {

using detail::TcType;

struct Case {
  const char* name;
  TcType type;
  int batch, heads, tokens, queries, dim;
  Mask mask;
  std::vector<std::int64_t> key_lengths;  // empty: all keys; else also the query lengths
  bool bias;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class TcAttention : public ::testing::TestWithParam<Case> {};

TEST_P(TcAttention, MatchesTheDoubleReferenceWithinTwiceTheNaiveError) {
  EMFLOW_REQUIRE_CUDA();
  const Case& c = GetParam();
  std::mt19937 random(1234u + static_cast<unsigned>(c.tokens * 7 + c.dim));
  const std::size_t hb = static_cast<std::size_t>(c.heads) * c.batch;
  const Rounded q = random_rounded(c.type, hb * c.queries * c.dim, random);
  const Rounded k = random_rounded(c.type, hb * c.tokens * c.dim, random);
  const Rounded v = random_rounded(c.type, hb * c.tokens * c.dim, random);
  std::vector<float> bias;
  if (c.bias) {
    std::uniform_real_distribution<float> uniform(-0.5f, 0.5f);
    for (std::size_t i = 0; i < hb * c.tokens; ++i) bias.push_back(uniform(random));
  }
  const float scale = 2.f / std::sqrt(static_cast<float>(c.dim)) * 1.4426950408889634f;

  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  cuda::DeviceBuffer<std::uint16_t> dq(q.bits.size()), dk(k.bits.size()), dv(v.bits.size());
  cuda::DeviceBuffer<float> dbias(std::max<std::size_t>(bias.size(), 1));
  cuda::DeviceBuffer<float> dout(hb * c.queries * c.dim), dlse(hb * c.queries);
  cuda::DeviceBuffer<std::int64_t> dlengths(std::max<std::size_t>(c.key_lengths.size(), 1));
  dq.copy_from_host(q.bits.data(), q.bits.size(), stream);
  dk.copy_from_host(k.bits.data(), k.bits.size(), stream);
  dv.copy_from_host(v.bits.data(), v.bits.size(), stream);
  if (c.bias) dbias.copy_from_host(bias.data(), bias.size(), stream);
  if (!c.key_lengths.empty()) {
    dlengths.copy_from_host(c.key_lengths.data(), c.key_lengths.size(), stream);
  }
  const std::vector<float> poison_out(dout.size(), std::nanf("")),
      poison_lse(dlse.size(), std::nanf(""));
  dout.copy_from_host(poison_out.data(), poison_out.size(), stream);
  dlse.copy_from_host(poison_lse.data(), poison_lse.size(), stream);

  detail::TcAttentionArgs args;
  args.type = c.type;
  args.query = dq.data();
  args.key = dk.data();
  args.value = dv.data();
  args.key_bias = c.bias ? dbias.data() : nullptr;
  args.scale = scale;
  args.out = dout.data();
  args.lse = dlse.data();
  args.batch = c.batch;
  args.heads = c.heads;
  args.tokens = c.tokens;
  args.queries = c.queries;
  args.dim = c.dim;
  args.mask.rule = c.mask;
  if (!c.key_lengths.empty()) {
    args.mask.key_lengths = args.mask.query_lengths = dlengths.data();
  }
  detail::launch_tc_attention(args, stream, "tensor-core attention");
  std::vector<float> out(dout.size()), lse(dlse.size());
  dout.copy_to_host(out.data(), out.size(), stream);
  dlse.copy_to_host(lse.data(), lse.size(), stream);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  cudaStreamDestroy(stream);

  const Result exact = attention(c, q.values, k.values, v.values, bias, scale, false);
  const Result naive = attention(c, q.values, k.values, v.values, bias, scale, true);
  const Result got{std::vector<double>(out.begin(), out.end()),
                   std::vector<double>(lse.begin(), lse.end())};
  expect_accuracy_rule(c.name, {got.out, got.lse}, {exact.out, exact.lse}, {naive.out, naive.lse});
}

const Mask kNone = Mask::none();
const Mask kCausal = Mask::causal();
const Mask kWindow5 = Mask::sliding_window(5);
const Mask kWindow37 = Mask::sliding_window(37);
constexpr TcType kBf16 = TcType::bf16;
constexpr TcType kF16 = TcType::f16;

// name, type, batch, heads, tokens, queries, dim, mask, key lengths, key bias
INSTANTIATE_TEST_SUITE_P(
    Cases, TcAttention,
    ::testing::Values(
        Case{"bf16_N1_d64_none", kBf16, 1, 1, 1, 1, 64, kNone, {}, false},
        Case{"f16_N1_d40_causal_bias", kF16, 2, 1, 1, 1, 40, kCausal, {}, true},
        Case{"bf16_N17_d64_causal_len", kBf16, 2, 2, 17, 17, 64, kCausal, {17, 9}, true},
        Case{"f16_N17_d128_window5", kF16, 1, 2, 17, 17, 128, kWindow5, {}, true},
        Case{"bf16_N17_d200_len", kBf16, 2, 1, 17, 17, 200, kNone, {5, 17}, false},
        Case{"bf16_N130_d128_len", kBf16, 1, 1, 130, 130, 128, kNone, {97}, true},
        Case{"f16_N130_d64_causal", kF16, 1, 1, 130, 130, 64, kCausal, {}, false},
        Case{"bf16_N130_d72_window37_len", kBf16, 2, 1, 130, 130, 72, kWindow37, {101, 130}, true},
        Case{"f16_N130_q3_d64_causal", kF16, 1, 2, 130, 3, 64, kCausal, {}, true}),
    [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace emflow::testing
#endif
