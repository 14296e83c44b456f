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

// The kernel's outputs for one case.
struct Outputs {
  std::vector<float> out, lse, entropy;
};

// The case's operands, drawn from its seed.
struct Inputs {
  Rounded q, k, v;
  std::vector<float> bias;
  float scale = 1.f;
};
Inputs inputs_of(const Case& c) {
  std::mt19937 random(1234u + static_cast<unsigned>(c.tokens * 7 + c.dim));
  const std::size_t hb = static_cast<std::size_t>(c.heads) * c.batch;
  const auto make = [&](std::size_t count) { return random_rounded(c.type, count, random); };
  Inputs in;
  in.q = make(hb * c.queries * c.dim);
  in.k = make(hb * c.tokens * c.dim);
  in.v = make(hb * c.tokens * c.dim);
  if (c.bias) {
    std::uniform_real_distribution<float> uniform(-0.5f, 0.5f);
    for (std::size_t i = 0; i < hb * c.tokens; ++i) in.bias.push_back(uniform(random));
  }
  in.scale = 2.f / std::sqrt(static_cast<float>(c.dim)) * 1.4426950408889634f;
  return in;
}

// Runs the kernel on the case, with query, key and value stored `offset` elements into their
// device arrays (offset 1 leaves them unaligned to 16 bytes: the kernel then loads its tiles by
// plain loads instead of cp.async). Outputs are poisoned (NaN) before the call.
Outputs run_kernel(const Case& c, const Inputs& in, std::size_t offset = 0) {
  const std::size_t hb = static_cast<std::size_t>(c.heads) * c.batch;
  const bool tf32_case = c.type == TcType::tf32;
  cudaStream_t stream = nullptr;
  EXPECT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  // Each operand as stored: 16-bit patterns, or floats for TF32.
  struct Operand {
    cuda::DeviceBuffer<std::uint16_t> bits;
    cuda::DeviceBuffer<float> floats;
    std::size_t offset = 0;
    const void* data() const {
      if (bits.size() > 0) return bits.data() + offset;
      return floats.data() + offset;
    }
  };
  auto upload = [&](const Rounded& r) {
    Operand o;
    o.offset = offset;
    if (tf32_case) {
      o.floats = cuda::DeviceBuffer<float>(r.values.size() + offset);
      cudaMemcpyAsync(o.floats.data() + offset, r.values.data(), r.values.size() * sizeof(float),
                      cudaMemcpyHostToDevice, stream);
    } else {
      o.bits = cuda::DeviceBuffer<std::uint16_t>(r.bits.size() + offset);
      cudaMemcpyAsync(o.bits.data() + offset, r.bits.data(), r.bits.size() * sizeof(std::uint16_t),
                      cudaMemcpyHostToDevice, stream);
    }
    return o;
  };
  Outputs result;
  result.out.assign(hb * c.queries * c.dim, 0.f);
  result.lse.assign(hb * c.queries, 0.f);
  result.entropy.assign(hb * c.queries, 0.f);
  const std::vector<float> poison_out(result.out.size(), std::nanf("")),
      poison_lse(result.lse.size(), std::nanf(""));
  const Operand dq = upload(in.q), dk = upload(in.k), dv = upload(in.v);
  cuda::DeviceBuffer<float> dbias(std::max<std::size_t>(in.bias.size(), 1));
  cuda::DeviceBuffer<float> dout(result.out.size()), dlse(result.lse.size()),
      dentropy(result.entropy.size());
  cuda::DeviceBuffer<std::int64_t> dlengths(std::max<std::size_t>(c.key_lengths.size(), 1));
  if (c.bias) dbias.copy_from_host(in.bias.data(), in.bias.size(), stream);
  if (!c.key_lengths.empty()) {
    dlengths.copy_from_host(c.key_lengths.data(), c.key_lengths.size(), stream);
  }
  dout.copy_from_host(poison_out.data(), poison_out.size(), stream);
  dlse.copy_from_host(poison_lse.data(), poison_lse.size(), stream);
  dentropy.copy_from_host(poison_lse.data(), poison_lse.size(), stream);

  detail::TcAttentionArgs args;
  args.type = c.type;
  args.query = dq.data();
  args.key = dk.data();
  args.value = dv.data();
  args.key_bias = c.bias ? dbias.data() : nullptr;
  args.scale = in.scale;
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
  EXPECT_EQ(args.splits, c.splits) << c.name << ": the case's splits are not whole tiles";
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
  dout.copy_to_host(result.out.data(), result.out.size(), stream);
  dlse.copy_to_host(result.lse.data(), result.lse.size(), stream);
  dentropy.copy_to_host(result.entropy.data(), result.entropy.size(), stream);
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  cudaStreamDestroy(stream);
  return result;
}

TEST_P(TcAttention, MatchesTheDoubleReferenceWithinTwiceTheNaiveError) {
  EMFLOW_REQUIRE_CUDA();
  const Case& c = GetParam();
  const Inputs in = inputs_of(c);
  const Outputs outputs = run_kernel(c, in);
  if (HasFailure()) return;

  // The naive kernel's operands: the stored values, rounded to TF32 as its products read them.
  const bool tf32_case = c.type == TcType::tf32;
  const std::vector<float> nq = tf32_case ? tf32(in.q.values) : in.q.values;
  const std::vector<float> nk = tf32_case ? tf32(in.k.values) : in.k.values;
  const std::vector<float> nv = tf32_case ? tf32(in.v.values) : in.v.values;
  const Result exact =
      attention(c, in.q.values, in.k.values, in.v.values, in.bias, in.scale, false);
  const Result naive = attention(c, nq, nk, nv, in.bias, in.scale, true);
  const Result got{std::vector<double>(outputs.out.begin(), outputs.out.end()),
                   std::vector<double>(outputs.lse.begin(), outputs.lse.end()),
                   std::vector<double>(outputs.entropy.begin(), outputs.entropy.end())};
  expect_accuracy_rule(c.name, {got.out, got.lse}, {exact.out, exact.lse}, {naive.out, naive.lse});
  expect_entropy_rule(c.name, got.entropy, exact.entropy, naive.entropy, exact.lse, c.tokens > 1);
}

// The two ways of loading the tiles compute the same thing: with rows of whole 16-byte chunks,
// the tiles come by cp.async from aligned arrays and by plain loads from the same values one
// element off, and the outputs are the same bits (the arithmetic does not depend on the loads).
TEST_P(TcAttention, AsyncCopiesAndPlainLoadsGiveTheSameBits) {
  EMFLOW_REQUIRE_CUDA();
  const Case& c = GetParam();
  const std::size_t element = c.type == TcType::tf32 ? 4 : 2;
  if ((static_cast<std::size_t>(c.dim) * element) % 16 != 0) {
    GTEST_SKIP() << c.name << ": rows of partial 16-byte chunks, loaded by plain loads always";
  }
  const Inputs in = inputs_of(c);
  const Outputs copied = run_kernel(c, in), plain = run_kernel(c, in, 1);
  if (HasFailure()) return;
  const auto same_bits = [](float a, float b) {
    return detail::float_bits(a) == detail::float_bits(b);
  };
  for (std::size_t i = 0; i < copied.out.size(); ++i) {
    ASSERT_TRUE(same_bits(copied.out[i], plain.out[i]))
        << c.name << ": out[" << i << "] " << copied.out[i] << " by cp.async, " << plain.out[i]
        << " by plain loads";
  }
  for (std::size_t i = 0; i < copied.lse.size(); ++i) {
    ASSERT_TRUE(same_bits(copied.lse[i], plain.lse[i])) << c.name << ": lse[" << i << "]";
    ASSERT_TRUE(same_bits(copied.entropy[i], plain.entropy[i]))
        << c.name << ": entropy[" << i << "]";
  }
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
