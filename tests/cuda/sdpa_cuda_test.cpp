// The SDPA-shaped operator on the GPU (emflow::sdpa_attend with Device::cuda, src/cuda/sdpa.cpp:
// the tensor-core attention kernel on the caller's projected queries, keys and values) against
// the double reference on the stored values, under the accuracy rule of the tensor cores: the
// output's error at most twice that of a naive computation in the same precision (the exact
// weights rounded to the storage type, or to TF32, before the product with V; the 16-bit output
// rounded once), lse within 1e-4 (1 + |lse|) and entropy within 1e-3 (1 + H) of the exact ones.
// Cases: bfloat16, float16 and float on TF32; grouped kv heads, multi-query, every mask, key and
// query lengths, explicit positions, few queries against many keys (key splits); the refusals
// of what the GPU does not compute, by name. Skipped without a device; tests/cuda/emulation runs
// it on the CPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "common/accuracy.hpp"
#include "common/testing.hpp"
#include "emflow/capability.hpp"
#include "emflow/precision.hpp"
#include "emflow/reference.hpp"
#include "emflow/sdpa.hpp"

#if defined(EMFLOW_WITH_CUDA)

namespace emflow::testing {
namespace {

struct SdpaGpuCase {
  std::string name;
  std::int64_t batch, query_heads, kv_heads, queries, keys, rank;
  reference::Visibility visibility;
  double scale = 0.4;
};

reference::Visibility visible(Mask mask, std::vector<std::int64_t> key_lengths = {},
                              std::vector<std::int64_t> query_lengths = {}) {
  reference::Visibility v;
  v.mask = mask;
  v.key_lengths = std::move(key_lengths);
  v.query_lengths = std::move(query_lengths);
  return v;
}

std::vector<SdpaGpuCase> cases() {
  std::vector<SdpaGpuCase> all{
      {"grouped_causal", 2, 4, 2, 70, 70, 64, visible(Mask::causal())},
      {"multi_query_window_lengths", 2, 3, 1, 33, 130, 32,
       visible(Mask::sliding_window(20), {130, 77}, {33, 12})},
      {"cross_no_mask_odd_rank", 1, 2, 2, 17, 90, 40, visible(Mask::none(), {50})},
      {"few_queries_many_keys_split", 1, 2, 1, 3, 700, 64, visible(Mask::causal())},
  };
  SdpaGpuCase positions{"positions_top_left", 2, 2, 2, 20, 40, 16, visible(Mask::causal())};
  positions.visibility.key_position = 3;
  positions.visibility.query_positions = {0, 25};
  all.push_back(positions);
  return all;
}

template <class T>
double stored_value(T v) {
  if constexpr (std::is_same_v<T, float>) {
    return static_cast<double>(v);
  } else {
    return static_cast<double>(to_float(v));
  }
}

// v stored in T (float: rounded to TF32).
template <class T>
T narrow_to(float v) {
  if constexpr (std::is_same_v<T, bfloat16>) return to_bfloat16(v);
  if constexpr (std::is_same_v<T, float16>) return to_float16(v);
  if constexpr (std::is_same_v<T, float>) return round_to_tf32(v);
}

// The value the products see: the 16-bit value, or a float rounded to TF32.
template <class T>
double rounded_weight(double p) {
  if constexpr (std::is_same_v<T, float>) {
    return static_cast<double>(round_to_tf32(static_cast<float>(p)));
  } else {
    return static_cast<double>(to_float(narrow_to<T>(static_cast<float>(p))));
  }
}

// Random values stored in T (floats: exact in TF32, so the kernel's rounding is exact).
template <class T>
std::vector<T> random_stored(std::size_t count, std::mt19937& random) {
  std::uniform_real_distribution<float> uniform(-1.f, 1.f);
  std::vector<T> out(count);
  for (T& v : out) v = narrow_to<T>(uniform(random));
  return out;
}

template <class T>
Tensor<double> tensor_of(const std::vector<T>& values, const Shape& shape) {
  Tensor<double> t(shape);
  for (std::int64_t e = 0; e < t.size(); ++e) t[e] = stored_value(values[static_cast<std::size_t>(e)]);
  return t;
}

template <class T>
class SdpaCuda : public ::testing::Test {};
using Storage = ::testing::Types<bfloat16, float16, float>;
TYPED_TEST_SUITE(SdpaCuda, Storage);

TYPED_TEST(SdpaCuda, MatchesTheDoubleReferenceWithinTwiceTheNaiveError) {
  EMFLOW_REQUIRE_CUDA();
  using T = TypeParam;
  const ExecutionOptions options{Device::cuda, 0,
                                 std::is_same_v<T, float> ? Precision::tf32 : Precision::fp32};
  for (const SdpaGpuCase& c : cases()) {
    SCOPED_TRACE(c.name);
    std::mt19937 random(77u + static_cast<unsigned>(c.keys));
    const std::int64_t B = c.batch, Hq = c.query_heads, Hkv = c.kv_heads, Nq = c.queries,
                       Nk = c.keys, r = c.rank;
    const std::vector<T> Q = random_stored<T>(static_cast<std::size_t>(B * Hq * Nq * r), random);
    const std::vector<T> K = random_stored<T>(static_cast<std::size_t>(B * Hkv * Nk * r), random);
    const std::vector<T> V = random_stored<T>(static_cast<std::size_t>(B * Hkv * Nk * r), random);
    SdpaInput<T> in;
    in.queries = Q.data();
    in.keys = K.data();
    in.values = V.data();
    in.batch = B;
    in.query_heads = Hq;
    in.kv_heads = Hkv;
    in.query_tokens = Nq;
    in.tokens = Nk;
    in.rank = in.value_rank = r;
    in.scale = c.scale;
    in.mask = c.visibility.mask;
    in.key_lengths = c.visibility.key_lengths.empty() ? nullptr : c.visibility.key_lengths.data();
    in.query_lengths =
        c.visibility.query_lengths.empty() ? nullptr : c.visibility.query_lengths.data();
    in.key_position = c.visibility.key_position;
    in.query_position = c.visibility.query_position;
    in.query_positions =
        c.visibility.query_positions.empty() ? nullptr : c.visibility.query_positions.data();
    const std::size_t rows = static_cast<std::size_t>(B * Hq * Nq);
    std::vector<T> out(rows * static_cast<std::size_t>(r), narrow_to<T>(std::nanf("")));
    std::vector<float> lse(rows, std::nanf("")), entropy(rows, std::nanf(""));
    sdpa_attend(in, SdpaOutput<T>{out.data(), lse.data(), entropy.data()}, options);

    const reference::SdpaAttention exact =
        reference::sdpa_attend(tensor_of(Q, {B, Hq, Nq, r}), tensor_of(K, {B, Hkv, Nk, r}),
                               tensor_of(V, {B, Hkv, Nk, r}), c.scale, c.visibility, true);
    // The naive output: the exact weights as the products see them, times V, rounded to T.
    std::vector<double> naive(rows * static_cast<std::size_t>(r), 0.0), ours, want;
    for (std::size_t row = 0; row < rows; ++row) {
      const std::int64_t b = static_cast<std::int64_t>(row) / (Hq * Nq);
      const std::int64_t h = static_cast<std::int64_t>(row) / Nq % Hq;
      const std::int64_t set = b * Hkv + h / (Hq / Hkv);
      for (std::int64_t j = 0; j < Nk; ++j) {
        const double p = exact.weights[static_cast<std::int64_t>(row) * Nk + j];
        if (!(p > 0.0)) continue;
        for (std::int64_t a = 0; a < r; ++a) {
          naive[row * r + a] += rounded_weight<T>(p) * stored_value(V[(set * Nk + j) * r + a]);
        }
      }
    }
    for (std::size_t e = 0; e < naive.size(); ++e) {
      if constexpr (!std::is_same_v<T, float>) {
        naive[e] = stored_value(narrow_to<T>(static_cast<float>(naive[e])));
      }
      ours.push_back(stored_value(out[e]));
      want.push_back(exact.output[static_cast<std::int64_t>(e)]);
    }
    EXPECT_EQ(check_rule("output", ours, naive, want), "");
    for (std::size_t row = 0; row < rows; ++row) {
      const double l = exact.lse[static_cast<std::int64_t>(row)];
      const double h = exact.entropy[static_cast<std::int64_t>(row)];
      if (std::isinf(l)) {
        EXPECT_EQ(lse[row], -INFINITY) << "row " << row << " sees no key";
        EXPECT_EQ(entropy[row], 0.f) << "row " << row;
        continue;
      }
      EXPECT_NEAR(lse[row], l, 1e-4 * (1.0 + std::fabs(l))) << "row " << row;
      EXPECT_NEAR(entropy[row], h, 1e-3 * (1.0 + h)) << "row " << row;
    }
  }
}

// What the GPU does not compute is refused by name on Device::cuda (and computed on the CPU under
// Device::automatic): float without TF32, double, value_rank unlike rank, rank beyond 256, and
// the backward pass.
TEST(SdpaCudaRefusals, WhatTheGpuDoesNotComputeIsNamed) {
  EMFLOW_REQUIRE_CUDA();
  const std::vector<float> Q(2 * 8 * 4, 0.5f), K(2 * 8 * 4, 0.25f), V(2 * 8 * 6, 1.f);
  SdpaInput<float> in;
  in.queries = Q.data();
  in.keys = K.data();
  in.values = V.data();
  in.query_tokens = in.tokens = 8;
  in.rank = in.value_rank = 4;
  std::vector<float> out(8 * 6), lse(8);
  EXPECT_TRUE(throws_error(
      [&] { sdpa_attend(in, SdpaOutput<float>{out.data(), lse.data()}, {Device::cuda, 0}); },
      ErrorCode::unsupported, {"sdpa_attend", "tensor cores", "Precision::tf32"}));
  in.value_rank = 6;
  EXPECT_TRUE(throws_error(
      [&] {
        sdpa_attend(in, SdpaOutput<float>{out.data(), lse.data()},
                    {Device::cuda, 0, Precision::tf32});
      },
      ErrorCode::unsupported, {"value_rank equal to rank", "6", "4"}));
  // Under Device::automatic the CPU computes what the GPU refuses.
  sdpa_attend(in, SdpaOutput<float>{out.data(), lse.data()}, {Device::automatic, 1});
  EXPECT_FLOAT_EQ(out[0], 1.f);  // every value is 1
  in.value_rank = 4;
  const std::vector<float> dO(8 * 4, 1.f);
  std::vector<float> dQ(8 * 4), dK(8 * 4), dV(8 * 4);
  EXPECT_TRUE(throws_error(
      [&] {
        sdpa_backward(in, SdpaSaved<float>{out.data(), lse.data()},
                      UpstreamGradients<float>{dO.data()},
                      SdpaGradientOutput<float>{dQ.data(), dK.data(), dV.data()},
                      {Device::cuda, 0, Precision::tf32});
      },
      ErrorCode::unsupported, {"sdpa_backward", "no GPU path"}));
}

}  // namespace
}  // namespace emflow::testing

#endif
