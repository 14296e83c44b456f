// The tensor-core attention kernel (kernels/tc_attention.cu) on bfloat16, float16 and float
// (TF32 products) inputs, at
// awkward sizes (N = 1, 17, 130; dims that leave part of a 16-wide step or of the tile empty),
// every mask, key lengths, key bias, lse and entropy; rows of whole 16-byte chunks (tiles by
// cp.async) and not (tiles by plain loads), tiles inside every row's visible keys (no mask) and
// across its edges. The accuracy rule (issue 16): against the
// double attention of the same rounded inputs, the kernel's error is at most twice the error of a
// naive implementation in the same precision (float scores, softmax and sums, the probabilities
// rounded to the 16-bit type before the product with V; for TF32 the naive kernel's operands
// and probabilities are rounded to TF32, tc_reference.hpp), plus 1e-6 for cases both compute
// exactly (entropy: a naive float kernel's -sum p ln p); with key splits too (each split's
// partial state merged by the float kernel's merge). Outputs are poisoned (NaN) before each
// call. Skipped without a device; tests/cuda/emulation runs them on the CPU (the model of mma.sync
// in kernels/mma.cuh).
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
  int splits = 1;  // key splits asked for (whole 64-key tiles each; fewer when the keys are few)
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class TcAttention : public ::testing::TestWithParam<Case> {};

TEST_P(TcAttention, MatchesTheDoubleReferenceWithinTwiceTheNaiveError) {
  EMFLOW_REQUIRE_CUDA();
  const Case& c = GetParam();
  std::mt19937 random(1234u + static_cast<unsigned>(c.tokens * 7 + c.dim));
  const std::size_t hb = static_cast<std::size_t>(c.heads) * c.batch;
  const bool tf32_case = c.type == TcType::tf32;
  const auto make = [&](std::size_t count) { return random_rounded(c.type, count, random); };
  const Rounded q = make(hb * c.queries * c.dim);
  const Rounded k = make(hb * c.tokens * c.dim);
  const Rounded v = make(hb * c.tokens * c.dim);
  std::vector<float> bias;
  if (c.bias) {
    std::uniform_real_distribution<float> uniform(-0.5f, 0.5f);
    for (std::size_t i = 0; i < hb * c.tokens; ++i) bias.push_back(uniform(random));
  }
  const float scale = 2.f / std::sqrt(static_cast<float>(c.dim)) * 1.4426950408889634f;

  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  // Each operand as stored: 16-bit patterns, or floats for TF32.
  struct Operand {
    cuda::DeviceBuffer<std::uint16_t> bits;
    cuda::DeviceBuffer<float> floats;
    const void* data() const {
      if (bits.size() > 0) return bits.data();
      return floats.data();
    }
  };
  auto upload = [&](const Rounded& r) {
    Operand o;
    if (tf32_case) {
      o.floats = cuda::DeviceBuffer<float>(r.values.size());
      o.floats.copy_from_host(r.values.data(), r.values.size(), stream);
    } else {
      o.bits = cuda::DeviceBuffer<std::uint16_t>(r.bits.size());
      o.bits.copy_from_host(r.bits.data(), r.bits.size(), stream);
    }
    return o;
  };
  const Operand dq = upload(q), dk = upload(k), dv = upload(v);
  cuda::DeviceBuffer<float> dbias(std::max<std::size_t>(bias.size(), 1));
  cuda::DeviceBuffer<float> dout(hb * c.queries * c.dim), dlse(hb * c.queries),
      dentropy(hb * c.queries);
  cuda::DeviceBuffer<std::int64_t> dlengths(std::max<std::size_t>(c.key_lengths.size(), 1));
  if (c.bias) dbias.copy_from_host(bias.data(), bias.size(), stream);
  if (!c.key_lengths.empty()) {
    dlengths.copy_from_host(c.key_lengths.data(), c.key_lengths.size(), stream);
  }
  const std::vector<float> poison_out(dout.size(), std::nanf("")),
      poison_lse(dlse.size(), std::nanf(""));
  dout.copy_from_host(poison_out.data(), poison_out.size(), stream);
  dlse.copy_from_host(poison_lse.data(), poison_lse.size(), stream);
  dentropy.copy_from_host(poison_lse.data(), poison_lse.size(), stream);

  detail::TcAttentionArgs args;
  args.type = c.type;
  args.query = dq.data();
  args.key = dk.data();
  args.value = dv.data();
  args.key_bias = c.bias ? dbias.data() : nullptr;
  args.scale = scale;
  args.out = dout.data();
  args.lse = dlse.data();
  args.entropy = dentropy.data();
  args.batch = c.batch;
  args.heads = c.heads;
  args.tokens = c.tokens;
  args.queries = c.queries;
  args.dim = c.dim;
  args.mask.rule = c.mask;
  if (!c.key_lengths.empty()) {
    args.mask.key_lengths = args.mask.query_lengths = dlengths.data();
  }
  // Key splits: whole tiles per split and no empty split, as the plans choose them
  // (choose_key_splits); the partial states in scratch, merged by the launch.
  const int tiles = (c.tokens + detail::kTcBlockKeys - 1) / detail::kTcBlockKeys;
  const int tiles_per_split = (tiles + c.splits - 1) / c.splits;
  args.splits = (tiles + tiles_per_split - 1) / tiles_per_split;
  args.split_keys = tiles_per_split * detail::kTcBlockKeys;
  ASSERT_EQ(args.splits, c.splits) << c.name << ": the case's splits are not whole tiles";
  const std::size_t split_stats = static_cast<std::size_t>(args.splits) * hb * c.queries;
  cuda::DeviceBuffer<float> split_out(split_stats * c.dim), split_lse(split_stats),
      split_entropy(split_stats);
  if (args.splits > 1) {
    args.split_out = split_out.data();
    args.split_lse = split_lse.data();
    args.split_entropy = split_entropy.data();
  }
  // The kernel's shared memory is allowed on this device first, as a plan does when it is made.
  detail::prepare_tc_attention(args.type, args.dim, "tensor-core attention");
  detail::launch_tc_attention(args, stream, "tensor-core attention");
  std::vector<float> out(dout.size()), lse(dlse.size()), entropy(dentropy.size());
  dout.copy_to_host(out.data(), out.size(), stream);
  dlse.copy_to_host(lse.data(), lse.size(), stream);
  dentropy.copy_to_host(entropy.data(), entropy.size(), stream);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  cudaStreamDestroy(stream);

  // The naive kernel's operands: the stored values, rounded to TF32 as its products read them.
  const std::vector<float> nq = tf32_case ? tf32(q.values) : q.values;
  const std::vector<float> nk = tf32_case ? tf32(k.values) : k.values;
  const std::vector<float> nv = tf32_case ? tf32(v.values) : v.values;
  const Result exact = attention(c, q.values, k.values, v.values, bias, scale, false);
  const Result naive = attention(c, nq, nk, nv, bias, scale, true);
  const Result got{std::vector<double>(out.begin(), out.end()),
                   std::vector<double>(lse.begin(), lse.end()),
                   std::vector<double>(entropy.begin(), entropy.end())};
  expect_accuracy_rule(c.name, {got.out, got.lse}, {exact.out, exact.lse}, {naive.out, naive.lse});
  expect_entropy_rule(c.name, got.entropy, exact.entropy, naive.entropy, exact.lse, c.tokens > 1);
}

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
        Case{"f16_N130_q3_d64_causal", kF16, 1, 2, 130, 3, 64, kCausal, {}, true},
        // 16-bit rows that are not whole 16-byte chunks: the tiles by plain loads, not cp.async
        Case{"bf16_N130_d37_causal_len", kBf16, 1, 2, 130, 130, 37, kCausal, {101}, true},
        Case{"f16_N200_d250_none", kF16, 1, 1, 200, 200, 250, kNone, {}, false},
        // TF32: dims that leave part of an 8-wide step empty, every block size (D = 64, 128, 256)
        Case{"tf32_N1_d20_none", kTf32, 1, 1, 1, 1, 20, kNone, {}, false},
        Case{"tf32_N17_d100_causal_len", kTf32, 2, 2, 17, 17, 100, kCausal, {17, 9}, true},
        Case{"tf32_N70_d61_window5_len", kTf32, 2, 1, 70, 70, 61, kWindow5, {70, 0}, true},
        Case{"tf32_N130_d64_none_len", kTf32, 1, 1, 130, 130, 64, kNone, {97}, false},
        Case{"tf32_N130_q5_d200_causal", kTf32, 1, 1, 130, 5, 200, kCausal, {}, true},
        // Key splits: three of one tile each, key lengths and a window leaving a split without a
        // visible key for some rows (partial states of no key merged), a cloud of no key, TF32.
        Case{"bf16_N130_q3_d64_causal_split3", kBf16, 1, 2, 130, 3, 64, kCausal, {}, true, 3},
        Case{"f16_N200_d40_window37_len_split4",
             kF16,
             2,
             1,
             200,
             200,
             40,
             kWindow37,
             {150, 200},
             true,
             4},
        Case{"tf32_N130_d100_causal_len_split2",
             kTf32,
             2,
             1,
             130,
             130,
             100,
             kCausal,
             {130, 0},
             false,
             2}),
    [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace emflow::testing
#endif
