// The SDPA-shaped operator on the GPU (emflow::sdpa_attend with Device::cuda, src/cuda/sdpa.cpp:
// the tensor-core attention kernel on the caller's projected queries, keys and values) against
// the double reference on the stored values, under the accuracy rule of the tensor cores: the
// output's error at most twice that of a naive computation in the same precision (the exact
// weights rounded to the storage type, or to TF32, before the product with V; the 16-bit output
// rounded once), lse within 1e-4 (1 + |lse|) and entropy within 1e-3 (1 + H) of the exact ones;
// and its backward pass (kernels/sdpa_backward.cu: the float32 kernels for float, the tensor-core
// kernels for 16-bit storage) against the double reference's gradients: within 1e-5 for float,
// and for 16-bit storage under the rule of docs/MATH.md §8.8 (at most twice the error of the
// naive 16-bit backward of tests/common/sdpa_case.hpp, which the CPU's paths meet too).
// Cases: bfloat16, float16 and float on TF32; grouped kv heads, multi-query, every mask, key and
// query lengths, explicit positions, few queries against many keys (key splits); the refusals
// of what the GPU does not compute, by name. Skipped without a device; tests/cuda/emulation runs
// it on the CPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "common/accuracy.hpp"
#include "common/sdpa_case.hpp"
#include "common/testing.hpp"
#include "core/dispatch.hpp"
#include "emflow/capability.hpp"
#include "emflow/precision.hpp"
#include "emflow/reference.hpp"
#include "emflow/sdpa.hpp"

#if defined(EMFLOW_WITH_CUDA)
#include <cuda_runtime.h>

#include "emflow/cuda.hpp"

namespace emflow::testing {
namespace {

reference::Visibility visible(Mask mask, std::vector<std::int64_t> key_lengths = {},
                              std::vector<std::int64_t> query_lengths = {}) {
  reference::Visibility v;
  v.mask = mask;
  v.key_lengths = std::move(key_lengths);
  v.query_lengths = std::move(query_lengths);
  return v;
}

constexpr double kScale = 0.4;

/// The cases of every test here (value rank equal to rank: the tensor-core forward needs it).
std::vector<SdpaCase> cases() {
  std::vector<SdpaCase> all{
      {"grouped_causal", 2, 4, 2, 70, 70, 64, 64, visible(Mask::causal()), kScale},
      {"multi_query_window_lengths", 2, 3, 1, 33, 130, 32, 32,
       visible(Mask::sliding_window(20), {130, 77}, {33, 12}), kScale},
      {"cross_no_mask_odd_rank", 1, 2, 2, 17, 90, 40, 40, visible(Mask::none(), {50}), kScale},
      {"few_queries_many_keys_split", 1, 2, 1, 3, 700, 64, 64, visible(Mask::causal()), kScale},
  };
  SdpaCase positions{"positions_top_left",    2,     2, 2, 20, 40, 16, 16,
                     visible(Mask::causal()), kScale};
  positions.visibility.key_position = 3;
  positions.visibility.query_positions = {0, 25};
  all.push_back(positions);
  return all;
}

/// The backward's (and the float32 forward's) cases: those above, a value rank unlike the rank
/// (the tensor-core forward cannot run it: the backward's saved output comes from the
/// reference), and rank and value rank beyond 64 (the kernels' wider tiles, D = 128).
std::vector<SdpaCase> backward_cases() {
  std::vector<SdpaCase> all = cases();
  all.push_back({"value_rank_unlike_rank", 2, 2, 1, 45, 70, 40, 24,
                 visible(Mask::causal(), {70, 31}), kScale});
  all.push_back({"wide_ranks", 1, 2, 1, 40, 75, 96, 128, visible(Mask::none(), {75}), kScale});
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

// v stored in T (float: as it is).
template <class T>
T stored_as(float v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return narrow_to<T>(v);
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
  for (std::int64_t e = 0; e < t.size(); ++e)
    t[e] = stored_value(values[static_cast<std::size_t>(e)]);
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
  for (const SdpaCase& c : cases()) {
    SCOPED_TRACE(c.name);
    std::mt19937 random(77u + static_cast<unsigned>(c.keys));
    const std::int64_t B = c.batch, Hq = c.query_heads, Hkv = c.kv_heads, Nq = c.queries,
                       Nk = c.keys, r = c.rank;
    const std::vector<T> Q = random_stored<T>(static_cast<std::size_t>(B * Hq * Nq * r), random);
    const std::vector<T> K = random_stored<T>(static_cast<std::size_t>(B * Hkv * Nk * r), random);
    const std::vector<T> V = random_stored<T>(static_cast<std::size_t>(B * Hkv * Nk * r), random);
    const SdpaInput<T> in = input_of(c, Q, K, V);
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

// The relative error ||a - b|| / ||b|| (b not all zero).
double relative_error(const std::vector<double>& a, const std::vector<double>& b) {
  double error = 0.0, norm = 0.0;
  for (std::size_t e = 0; e < a.size(); ++e) {
    error += (a[e] - b[e]) * (a[e] - b[e]);
    norm += b[e] * b[e];
  }
  return std::sqrt(error / norm);
}

// Float with Precision::fp32 on the GPU: the float32 kernel (kernels/sdpa_backward.cu), float
// products, against the double reference on every case of the backward (value ranks unlike the
// rank and the width-128 tiles included): the output within 1e-5 relative (the CPU engine's
// bound), lse and entropy per row, rows that see no key exactly o = 0, lse = -inf, H = 0 (the
// buffers start as NaN). Without lse and entropy asked, the output keeps its bits.
TEST(SdpaCudaFloat32, ForwardMatchesTheDoubleReference) {
  EMFLOW_REQUIRE_CUDA();
  const ExecutionOptions options{Device::cuda, 0, Precision::fp32};
  for (const SdpaCase& c : backward_cases()) {
    SCOPED_TRACE(c.name);
    std::mt19937 random(91u + static_cast<unsigned>(c.keys));
    const std::int64_t B = c.batch, Hq = c.query_heads, Hkv = c.kv_heads, Nq = c.queries,
                       Nk = c.keys, r = c.rank, rv = c.value_rank;
    // Full float values (not TF32-exact as random_stored makes them): float products.
    std::uniform_real_distribution<float> uniform(-1.f, 1.f);
    const auto floats = [&](std::int64_t count) {
      std::vector<float> v(static_cast<std::size_t>(count));
      for (float& x : v) x = uniform(random);
      return v;
    };
    const std::vector<float> Q = floats(B * Hq * Nq * r), K = floats(B * Hkv * Nk * r),
                             V = floats(B * Hkv * Nk * rv);
    const SdpaInput<float> in = input_of(c, Q, K, V);
    const std::size_t rows = static_cast<std::size_t>(B * Hq * Nq);
    std::vector<float> out(rows * static_cast<std::size_t>(rv), std::nanf(""));
    std::vector<float> lse(rows, std::nanf("")), entropy(rows, std::nanf(""));
    sdpa_attend(in, SdpaOutput<float>{out.data(), lse.data(), entropy.data()}, options);
    EXPECT_EQ(detail::last_route().kernel, Kernel::cuda_fused);
    EXPECT_EQ(detail::last_route().device, Device::cuda);

    const reference::SdpaAttention exact =
        reference::sdpa_attend(tensor_of(Q, {B, Hq, Nq, r}), tensor_of(K, {B, Hkv, Nk, r}),
                               tensor_of(V, {B, Hkv, Nk, rv}), c.scale, c.visibility, true);
    std::vector<double> ours(out.begin(), out.end());
    const std::vector<double> want(exact.output.values().begin(), exact.output.values().end());
    EXPECT_LT(relative_error(ours, want), 1e-5);
    std::size_t without_keys = 0;
    for (std::size_t row = 0; row < rows; ++row) {
      const double l = exact.lse[static_cast<std::int64_t>(row)];
      const double h = exact.entropy[static_cast<std::int64_t>(row)];
      if (std::isinf(l)) {
        ++without_keys;
        EXPECT_EQ(lse[row], -INFINITY) << "row " << row << " sees no key";
        EXPECT_EQ(entropy[row], 0.f) << "row " << row;
        for (std::int64_t a = 0; a < rv; ++a) ASSERT_EQ(out[row * rv + a], 0.f) << "row " << row;
        continue;
      }
      EXPECT_NEAR(lse[row], l, 1e-5 * (1.0 + std::fabs(l))) << "row " << row;
      EXPECT_NEAR(entropy[row], h, 1e-4 * (1.0 + h)) << "row " << row;
      for (std::int64_t a = 0; a < rv; ++a) {
        ASSERT_NEAR(out[row * rv + a], want[row * rv + a], 2e-5) << "row " << row << " col " << a;
      }
    }
    if (!c.visibility.query_lengths.empty()) {
      EXPECT_GT(without_keys, 0u);
    }
    std::vector<float> alone(out.size(), std::nanf(""));
    sdpa_attend(in, SdpaOutput<float>{alone.data()}, options);
    EXPECT_EQ(alone, out);
  }
}

template <class T>
std::vector<double> values_of_stored(const std::vector<T>& v) {
  std::vector<double> out;
  for (const T& x : v) out.push_back(stored_value(x));
  return out;
}

// The reference's gradients with 0 where it leaves NaN (rows without keys, never read).
std::vector<double> zero_nan(const Tensor<double>& t) {
  std::vector<double> out(t.values().begin(), t.values().end());
  for (double& v : out) v = std::isnan(v) ? 0.0 : v;
  return out;
}

// The backward pass on the GPU (the float32 kernels; 16-bit storage widened and the gradients
// rounded once) against the double reference through every upstream gradient at once: float
// within 1e-5 relative per gradient (the CPU engine's bound) and dscale within 1e-5 of the size
// of its terms; bfloat16 and float16 within 2^-7 and 2^-10 relative (twice the rounding of the
// storage type). The saved statistics and upstream gradients of rows that see no key hold NaN
// (never read): their dQ rows are exactly 0, as are dK and dV of keys no query sees.
TYPED_TEST(SdpaCuda, GradientsMatchTheDoubleReference) {
  EMFLOW_REQUIRE_CUDA();
  using T = TypeParam;
  const double bound = std::is_same_v<T, float>      ? 1e-5
                       : std::is_same_v<T, bfloat16> ? std::ldexp(1.0, -7)
                                                     : std::ldexp(1.0, -10);
  const std::vector<SdpaCase> all = backward_cases();
  double worst[] = {0.0, 0.0, 0.0};  // the largest error over the naive error, per gradient
  for (const SdpaCase& c : all) {
    SCOPED_TRACE(c.name);
    std::mt19937 random(91u + static_cast<unsigned>(c.keys));
    const std::int64_t B = c.batch, Hq = c.query_heads, Hkv = c.kv_heads, Nq = c.queries,
                       Nk = c.keys, r = c.rank, rv = c.value_rank;
    const std::vector<T> Q = random_stored<T>(static_cast<std::size_t>(B * Hq * Nq * r), random);
    const std::vector<T> K = random_stored<T>(static_cast<std::size_t>(B * Hkv * Nk * r), random);
    const std::vector<T> V = random_stored<T>(static_cast<std::size_t>(B * Hkv * Nk * rv), random);
    const Tensor<double> q = tensor_of(Q, {B, Hq, Nq, r}), k = tensor_of(K, {B, Hkv, Nk, r}),
                         v = tensor_of(V, {B, Hkv, Nk, rv});
    const reference::SdpaAttention forward =
        reference::sdpa_attend(q, k, v, c.scale, c.visibility, /*with_weights=*/true);
    reference::OutputGradients up;
    up.update = Tensor<double>({B, Hq, Nq, rv});
    up.lse = Tensor<double>({B, Hq, Nq});
    up.entropy = Tensor<double>({B, Hq, Nq});
    std::uniform_real_distribution<double> uniform(-1.0, 1.0);
    for (std::int64_t e = 0; e < up.update.size(); ++e) {
      up.update[e] = stored_value(stored_as<T>(static_cast<float>(uniform(random))));
    }
    for (std::int64_t e = 0; e < up.lse.size(); ++e) {
      up.lse[e] = static_cast<float>(uniform(random));
      up.entropy[e] = static_cast<float>(0.3 * uniform(random));
    }
    const reference::SdpaGradients exact =
        reference::sdpa_backward(q, k, v, c.scale, c.visibility, up);

    // The saved forward and the upstream gradients as stored, NaN on rows without keys.
    const std::size_t rows = static_cast<std::size_t>(B * Hq * Nq);
    std::vector<T> O(rows * rv), dO(rows * rv);
    std::vector<float> lse(rows), H(rows), dlse(rows), dH(rows);
    for (std::size_t row = 0; row < rows; ++row) {
      const bool keyless = std::isinf(forward.lse[static_cast<std::int64_t>(row)]);
      const float nan = std::nanf("");
      lse[row] = keyless ? nan : static_cast<float>(forward.lse[static_cast<std::int64_t>(row)]);
      H[row] = keyless ? nan : static_cast<float>(forward.entropy[static_cast<std::int64_t>(row)]);
      dlse[row] = keyless ? nan : static_cast<float>(up.lse[static_cast<std::int64_t>(row)]);
      dH[row] = keyless ? nan : static_cast<float>(up.entropy[static_cast<std::int64_t>(row)]);
      for (std::int64_t a = 0; a < rv; ++a) {
        const auto at = static_cast<std::int64_t>(row) * rv + a;
        O[static_cast<std::size_t>(at)] = stored_as<T>(static_cast<float>(forward.output[at]));
        dO[static_cast<std::size_t>(at)] =
            keyless ? stored_as<T>(nan) : stored_as<T>(static_cast<float>(up.update[at]));
      }
    }
    const SdpaInput<T> in = input_of(c, Q, K, V);
    std::vector<T> dQ(Q.size(), narrow_to<T>(std::nanf(""))),
        dK(K.size(), narrow_to<T>(std::nanf(""))), dV(V.size(), narrow_to<T>(std::nanf("")));
    double dscale = std::nan("");
    sdpa_backward(in, SdpaSaved<T>{O.data(), lse.data(), H.data()},
                  UpstreamGradients<T>{dO.data(), dlse.data(), dH.data()},
                  SdpaGradientOutput<T>{dQ.data(), dK.data(), dV.data(), &dscale},
                  ExecutionOptions{Device::cuda, 0});
    // float32 kernels for float, the tensor-core kernels for 16-bit storage.
    const Kernel kernel = std::is_same_v<T, float> ? Kernel::cuda_fused : Kernel::cuda_tensor_cores;
    EXPECT_EQ(detail::last_route().kernel, kernel);
    const std::vector<double> ours[] = {values_of_stored(dQ), values_of_stored(dK),
                                        values_of_stored(dV)};
    const std::vector<double> want[] = {zero_nan(exact.queries), zero_nan(exact.keys),
                                        zero_nan(exact.values)};
    const char* names[] = {"dQ", "dK", "dV"};
    if constexpr (!std::is_same_v<T, float>) {
      // The 16-bit rule (docs/MATH.md §8.8): at most twice the error of the naive backward.
      const NaiveGradients naive =
          naive_sdpa_backward<T>(c, q, k, v, forward.weights, O.data(), lse.data(), H.data(), up);
      const std::vector<double>* naives[] = {&naive.queries, &naive.keys, &naive.values};
      for (int e = 0; e < 3; ++e) {
        EXPECT_EQ(check_rule(names[e], ours[e], *naives[e], want[e]), "");
        const double naive_error = max_error(*naives[e], want[e]);
        if (naive_error > 0) {
          worst[e] = std::max(worst[e], max_error(ours[e], want[e]) / naive_error);
        }
      }
    }
    for (int e = 0; e < 3; ++e) {
      EXPECT_LE(relative_error(ours[e], want[e]), bound) << names[e];
      for (std::size_t i = 0; i < want[e].size(); ++i) {
        if (want[e][i] == 0.0 && !std::isfinite(ours[e][i])) {
          ADD_FAILURE() << names[e] << "[" << i << "] is " << ours[e][i] << ", expected 0";
          break;
        }
      }
    }
    // Rows without keys: dQ exactly 0.
    for (std::size_t row = 0; row < rows; ++row) {
      if (!std::isnan(lse[row])) continue;
      for (std::int64_t a = 0; a < r; ++a) {
        ASSERT_EQ(ours[0][row * static_cast<std::size_t>(r) + static_cast<std::size_t>(a)], 0.0)
            << "dQ row " << row << " sees no key";
      }
    }
    // dscale = sum_i <dQ_i, q_i> / scale, held to the size of its terms.
    double size = 0.0;
    for (std::size_t i = 0; i < want[0].size(); ++i)
      size += std::fabs(want[0][i] * q[static_cast<std::int64_t>(i)]);
    EXPECT_NEAR(dscale, exact.scale, 4 * bound * size / c.scale + 1e-9) << "dscale";
  }
  if constexpr (!std::is_same_v<T, float>) {  // how close the kernels come to the rule's 2
    const char* names[] = {"dQ", "dK", "dV"};
    for (int e = 0; e < 3; ++e) {
      std::cout << "[margin] " << (std::is_same_v<T, bfloat16> ? "bfloat16 " : "float16 ")
                << names[e] << " on the GPU: largest error / naive error " << worst[e] << std::endl;
    }
  }
}

// Non-finite input goes to the reference on the GPU as on the cpu: a NaN in a real key gives
// the same outputs (NaN exactly on the rows that see it) on both devices.
TEST(SdpaCudaNonFinite, ANanKeyGivesTheCpusResult) {
  EMFLOW_REQUIRE_CUDA();
  std::mt19937 random(5u);
  const std::int64_t Nq = 9, Nk = 20, r = 16;
  const std::vector<bfloat16> Q = random_stored<bfloat16>(Nq * r, random);
  std::vector<bfloat16> K = random_stored<bfloat16>(Nk * r, random);
  const std::vector<bfloat16> V = random_stored<bfloat16>(Nk * r, random);
  K[5 * r + 3] = to_bfloat16(std::nanf(""));  // key 5: seen by the causal rows from 5 on
  SdpaInput<bfloat16> in;
  in.queries = Q.data();
  in.keys = K.data();
  in.values = V.data();
  in.query_tokens = Nq;
  in.tokens = Nk;
  in.rank = in.value_rank = r;
  in.mask = Mask::causal();
  in.query_position = 0;
  std::vector<bfloat16> gpu(Nq * r), cpu(Nq * r);
  std::vector<float> gpu_lse(Nq), cpu_lse(Nq);
  sdpa_attend(in, SdpaOutput<bfloat16>{gpu.data(), gpu_lse.data()}, {Device::cuda, 0});
  sdpa_attend(in, SdpaOutput<bfloat16>{cpu.data(), cpu_lse.data()}, {Device::cpu, 1});
  for (std::int64_t i = 0; i < Nq; ++i) {
    EXPECT_EQ(std::isnan(gpu_lse[i]), i >= 5) << "row " << i;
    EXPECT_EQ(detail::float_bits(gpu_lse[i]), detail::float_bits(cpu_lse[i])) << "row " << i;
    for (std::int64_t a = 0; a < r; ++a) {
      EXPECT_EQ(gpu[i * r + a].bits, cpu[i * r + a].bits) << "row " << i << ", column " << a;
    }
  }
}

// What the GPU does not compute is refused by name on Device::cuda (and computed on the CPU under
// Device::automatic): float without TF32, value_rank unlike rank, and float64 in the backward.
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
  // Float with Precision::fp32 runs the float32 kernel up to rank and value_rank 128.
  const std::vector<float> Qw(8 * 130, 0.5f);
  SdpaInput<float> wide_float = in;
  wide_float.queries = wide_float.keys = wide_float.values = Qw.data();
  wide_float.rank = wide_float.value_rank = 130;
  std::vector<float> wide_out(8 * 130);
  EXPECT_TRUE(throws_error(
      [&] {
        sdpa_attend(wide_float, SdpaOutput<float>{wide_out.data(), lse.data()}, {Device::cuda, 0});
      },
      ErrorCode::unsupported, {"sdpa_attend", "float32 SDPA", "<= 128", "130", "Precision::tf32"}));
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
  // The backward: float32 kernels up to rank 128; float64 on the cpu.
  const std::vector<double> Q64(8 * 130, 0.5), V64(8 * 130, 1.0);
  SdpaInput<double> wide;
  wide.queries = wide.keys = Q64.data();
  wide.values = V64.data();
  wide.query_tokens = wide.tokens = 8;
  wide.rank = wide.value_rank = 130;
  std::vector<double> out64(8 * 130), lse64(8), dQ(8 * 130), dK(8 * 130), dV(8 * 130);
  EXPECT_TRUE(throws_error(
      [&] {
        sdpa_backward(wide, SdpaSaved<double>{out64.data(), lse64.data()},
                      UpstreamGradients<double>{V64.data()},
                      SdpaGradientOutput<double>{dQ.data(), dK.data(), dV.data()},
                      {Device::cuda, 0});
      },
      ErrorCode::unsupported, {"sdpa_backward", "float64"}));
}

// --- The stream-ordered forms (cuda::sdpa_attend_async, cuda::sdpa_backward_async) -------------

// A host array on the device (empty for an empty array).
template <class V>
cuda::DeviceBuffer<V> on_device(const std::vector<V>& host, cudaStream_t stream) {
  cuda::DeviceBuffer<V> buffer(host.size());
  if (!host.empty()) buffer.copy_from_host(host.data(), host.size(), stream);
  return buffer;
}

template <class V>
std::vector<V> to_host(const cuda::DeviceBuffer<V>& buffer, cudaStream_t stream) {
  std::vector<V> host(buffer.size());
  if (!host.empty()) buffer.copy_to_host(host.data(), host.size(), stream);
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  return host;
}

template <class V>
std::vector<std::uint64_t> bits_of(const std::vector<V>& values) {
  std::vector<std::uint64_t> out;
  for (const V& v : values) {
    std::uint64_t b = 0;
    std::memcpy(&b, &v, sizeof(V));
    out.push_back(b);
  }
  return out;
}

struct Stream {
  cudaStream_t handle = nullptr;
  Stream() { EXPECT_EQ(cudaStreamCreateWithFlags(&handle, cudaStreamNonBlocking), cudaSuccess); }
  ~Stream() {
    if (handle != nullptr) cudaStreamDestroy(handle);
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
};

// The stream-ordered forms on the caller's device arrays give the blocking forms' results bit for
// bit (the blocking forms run them on device copies of host arrays): every case above, forward
// and backward, with lengths and positions in device memory (read by the kernels alone), a
// workspace of the caller's, and the saved statistics of keyless rows NaN (never read). And the
// backward's atomics mode (cuda::SdpaBackwardOptions) against its deterministic mode.
TYPED_TEST(SdpaCuda, StreamOrderedFormsGiveTheBlockingFormsBits) {
  EMFLOW_REQUIRE_CUDA();
  using T = TypeParam;
  const Precision precision = std::is_same_v<T, float> ? Precision::tf32 : Precision::fp32;
  const std::vector<SdpaCase> all = backward_cases();
  const Stream stream;
  const cudaStream_t s = stream.handle;
  for (const SdpaCase& c : all) {
    SCOPED_TRACE(c.name);
    const bool backward_only = c.value_rank != c.rank;  // the forward needs rv = r
    std::mt19937 random(13u + static_cast<unsigned>(c.keys));
    const std::int64_t B = c.batch, Hq = c.query_heads, Hkv = c.kv_heads, Nq = c.queries,
                       Nk = c.keys, r = c.rank, rv = c.value_rank;
    const std::vector<T> Q = random_stored<T>(static_cast<std::size_t>(B * Hq * Nq * r), random);
    const std::vector<T> K = random_stored<T>(static_cast<std::size_t>(B * Hkv * Nk * r), random);
    const std::vector<T> V = random_stored<T>(static_cast<std::size_t>(B * Hkv * Nk * rv), random);
    const SdpaInput<T> host = input_of(c, Q, K, V);
    const std::size_t rows = static_cast<std::size_t>(B * Hq * Nq);

    // The device copies, the lengths and positions among them.
    const auto dQ_in = on_device(Q, s), dK_in = on_device(K, s), dV_in = on_device(V, s);
    const auto key_lengths = on_device(c.visibility.key_lengths, s);
    const auto query_lengths = on_device(c.visibility.query_lengths, s);
    const auto query_positions = on_device(c.visibility.query_positions, s);
    SdpaInput<T> device = host;
    device.queries = dQ_in.data();
    device.keys = dK_in.data();
    device.values = dV_in.data();
    device.key_lengths = host.key_lengths ? key_lengths.data() : nullptr;
    device.query_lengths = host.query_lengths ? query_lengths.data() : nullptr;
    device.query_positions = host.query_positions ? query_positions.data() : nullptr;

    // The saved forward: the blocking form's where it runs (rv = r), else the reference's.
    std::vector<T> O(rows * static_cast<std::size_t>(rv));
    std::vector<float> lse(rows), H(rows);
    if (!backward_only) {
      sdpa_attend(host, SdpaOutput<T>{O.data(), lse.data(), H.data()},
                  ExecutionOptions{Device::cuda, 0, precision});
      cuda::DeviceBuffer<T> out(O.size());
      cuda::DeviceBuffer<float> out_lse(rows), out_entropy(rows);
      const SdpaOutput<T> where{out.data(), out_lse.data(), out_entropy.data()};
      const cuda::PlanOptions options{Algorithm::automatic, precision};
      cuda::DeviceBuffer<unsigned char> workspace(
          cuda::sdpa_workspace_size(device, where, options));
      cuda::sdpa_attend_async(device, where, workspace.data(), workspace.bytes(), s, options);
      EXPECT_EQ(bits_of(to_host(out, s)), bits_of(O)) << "output";
      EXPECT_EQ(bits_of(to_host(out_lse, s)), bits_of(lse)) << "lse";
      EXPECT_EQ(bits_of(to_host(out_entropy, s)), bits_of(H)) << "entropy";
    } else {
      const reference::SdpaAttention f =
          reference::sdpa_attend(tensor_of(Q, {B, Hq, Nq, r}), tensor_of(K, {B, Hkv, Nk, r}),
                                 tensor_of(V, {B, Hkv, Nk, rv}), c.scale, c.visibility);
      for (std::size_t e = 0; e < O.size(); ++e) {
        O[e] = stored_as<T>(static_cast<float>(f.output[static_cast<std::int64_t>(e)]));
      }
      for (std::size_t row = 0; row < rows; ++row) {
        lse[row] = static_cast<float>(f.lse[static_cast<std::int64_t>(row)]);
        H[row] = static_cast<float>(f.entropy[static_cast<std::int64_t>(row)]);
      }
    }
    // Keyless rows: NaN statistics and upstream gradients, which neither form reads.
    std::uniform_real_distribution<float> uniform(-1.f, 1.f);
    std::vector<T> dO(O.size());
    std::vector<float> dlse(rows), dH(rows);
    for (std::size_t row = 0; row < rows; ++row) {
      const bool keyless = std::isinf(lse[row]);
      if (keyless) lse[row] = H[row] = std::nanf("");
      dlse[row] = keyless ? std::nanf("") : uniform(random);
      dH[row] = keyless ? std::nanf("") : 0.3f * uniform(random);
      for (std::int64_t a = 0; a < rv; ++a) {
        dO[row * static_cast<std::size_t>(rv) + static_cast<std::size_t>(a)] =
            stored_as<T>(keyless ? std::nanf("") : uniform(random));
      }
    }
    std::vector<T> gQ(Q.size()), gK(K.size()), gV(V.size());
    double gscale = 0.0;
    sdpa_backward(host, SdpaSaved<T>{O.data(), lse.data(), H.data()},
                  UpstreamGradients<T>{dO.data(), dlse.data(), dH.data()},
                  SdpaGradientOutput<T>{gQ.data(), gK.data(), gV.data(), &gscale},
                  ExecutionOptions{Device::cuda, 0});
    const auto saved_O = on_device(O, s);
    const auto saved_lse = on_device(lse, s), saved_H = on_device(H, s);
    const auto up_dO = on_device(dO, s);
    const auto up_dlse = on_device(dlse, s), up_dH = on_device(dH, s);
    cuda::DeviceBuffer<T> dQ(Q.size()), dK(K.size()), dV(V.size());
    cuda::DeviceBuffer<double> dscale(1);
    const SdpaSaved<T> saved{saved_O.data(), saved_lse.data(), saved_H.data()};
    const UpstreamGradients<T> upstream{up_dO.data(), up_dlse.data(), up_dH.data()};
    const SdpaGradientOutput<T> gradients{dQ.data(), dK.data(), dV.data(), dscale.data()};
    cuda::DeviceBuffer<unsigned char> workspace(
        cuda::sdpa_backward_workspace_size(device, upstream, gradients));
    cuda::sdpa_backward_async(device, saved, upstream, gradients, workspace.data(),
                              workspace.bytes(), s);
    EXPECT_EQ(bits_of(to_host(dQ, s)), bits_of(gQ)) << "dQ";
    EXPECT_EQ(bits_of(to_host(dK, s)), bits_of(gK)) << "dK";
    EXPECT_EQ(bits_of(to_host(dV, s)), bits_of(gV)) << "dV";
    EXPECT_EQ(to_host(dscale, s)[0], gscale) << "dscale";

    // The backward as a plan (cuda::AttentionPlan from the shapes with null arrays), run twice on
    // one workspace into gradients filled with NaN first: the same bits each time.
    SdpaInput<T> shapes = device;
    shapes.queries = shapes.keys = shapes.values = nullptr;
    const cuda::AttentionPlan<T> plan(shapes, upstream, gradients);
    ASSERT_TRUE(plan.matches(device, saved, upstream, gradients));
    EXPECT_FALSE(plan.matches(device, saved, UpstreamGradients<T>{up_dO.data()}, gradients));
    EXPECT_EQ(plan.workspace_size(), workspace.bytes());
    for (int run = 0; run < 2; ++run) {
      SCOPED_TRACE("backward plan, run " + std::to_string(run));
      ASSERT_EQ(cudaMemsetAsync(dQ.data(), 0xFF, dQ.bytes(), s), cudaSuccess);
      ASSERT_EQ(cudaMemsetAsync(dK.data(), 0xFF, dK.bytes(), s), cudaSuccess);
      ASSERT_EQ(cudaMemsetAsync(dV.data(), 0xFF, dV.bytes(), s), cudaSuccess);
      ASSERT_EQ(cudaMemsetAsync(dscale.data(), 0xFF, dscale.bytes(), s), cudaSuccess);
      plan.run(device, saved, upstream, gradients, workspace.data(), workspace.bytes(), s);
      EXPECT_EQ(bits_of(to_host(dQ, s)), bits_of(gQ)) << "dQ";
      EXPECT_EQ(bits_of(to_host(dK, s)), bits_of(gK)) << "dK";
      EXPECT_EQ(bits_of(to_host(dV, s)), bits_of(gV)) << "dV";
      EXPECT_EQ(to_host(dscale, s)[0], gscale) << "dscale";
    }

    // The atomics mode (dQ added by the keys' kernel): dK and dV the same bits, dQ within a
    // rounding of the storage type (its sums in another order) and exactly 0 where it is 0,
    // dscale (summed over key blocks instead of query blocks) to float rounding.
    const cuda::SdpaBackwardOptions atomics{false};
    cuda::DeviceBuffer<T> aQ(Q.size()), aK(K.size()), aV(V.size());
    cuda::DeviceBuffer<double> ascale(1);
    const SdpaGradientOutput<T> atomic{aQ.data(), aK.data(), aV.data(), ascale.data()};
    cuda::DeviceBuffer<unsigned char> atomic_workspace(
        cuda::sdpa_backward_workspace_size(device, upstream, atomic, atomics));
    cuda::sdpa_backward_async(device, saved, upstream, atomic, atomic_workspace.data(),
                              atomic_workspace.bytes(), s, atomics);
    EXPECT_EQ(bits_of(to_host(aK, s)), bits_of(gK)) << "dK, atomics";
    EXPECT_EQ(bits_of(to_host(aV, s)), bits_of(gV)) << "dV, atomics";
    const std::vector<double> atomic_dQ = values_of_stored(to_host(aQ, s));
    const std::vector<double> blocking_dQ = values_of_stored(gQ);
    const double rounding = std::is_same_v<T, float>      ? 1e-5
                            : std::is_same_v<T, bfloat16> ? std::ldexp(1.0, -7)
                                                          : std::ldexp(1.0, -10);
    EXPECT_LE(relative_error(atomic_dQ, blocking_dQ), rounding) << "dQ, atomics";
    for (std::size_t e = 0; e < blocking_dQ.size(); ++e) {
      if (blocking_dQ[e] == 0.0 && atomic_dQ[e] != 0.0) {
        ADD_FAILURE() << "dQ[" << e << "] is " << atomic_dQ[e] << " with atomics, expected 0";
        break;
      }
    }
    EXPECT_NEAR(to_host(ascale, s)[0], gscale, 1e-4 * (1.0 + std::fabs(gscale)))
        << "dscale, atomics";
  }
}

// The forward pass as a plan (cuda::AttentionPlan made from SdpaInput): made once from the shapes
// with null arrays, run twice on one workspace with other arrays and another scale, each run
// bitwise the blocking form's (which the tests above hold against the double reference), into
// outputs filled with NaN first so that an untouched output fails; its size is
// sdpa_workspace_size's and matches() tells its calls from others. Float in both precisions: TF32
// on the tensor cores, fp32 on the float32 kernel (whose value rank may differ from the rank).
TYPED_TEST(SdpaCuda, APlanMadeOnceRunsTwiceAsTheBlockingForm) {
  EMFLOW_REQUIRE_CUDA();
  using T = TypeParam;
  std::vector<Precision> precisions{Precision::fp32};
  if (std::is_same_v<T, float>) precisions = {Precision::tf32, Precision::fp32};
  const Stream stream;
  const cudaStream_t s = stream.handle;
  std::vector<SdpaCase> all = cases();
  if (std::is_same_v<T, float>) all.push_back(backward_cases()[5]);  // rv != r
  for (const Precision precision : precisions) {
    for (const SdpaCase& c : all) {
      const bool tensor_cores = !std::is_same_v<T, float> || precision == Precision::tf32;
      if (tensor_cores && c.value_rank != c.rank) continue;
      SCOPED_TRACE(c.name + (precision == Precision::tf32 ? " tf32" : " fp32"));
      const std::int64_t B = c.batch, Hq = c.query_heads, Hkv = c.kv_heads, Nq = c.queries,
                         Nk = c.keys, r = c.rank, rv = c.value_rank;
      const std::size_t rows = static_cast<std::size_t>(B * Hq * Nq);
      const auto key_lengths = on_device(c.visibility.key_lengths, s);
      const auto query_lengths = on_device(c.visibility.query_lengths, s);
      const auto query_positions = on_device(c.visibility.query_positions, s);
      cuda::DeviceBuffer<T> out(rows * static_cast<std::size_t>(rv));
      cuda::DeviceBuffer<float> out_lse(rows), out_entropy(rows);
      const SdpaOutput<T> where{out.data(), out_lse.data(), out_entropy.data()};
      const cuda::PlanOptions options{Algorithm::automatic, precision};

      const std::vector<T> none;
      SdpaInput<T> shapes = input_of(c, none, none, none);
      shapes.queries = shapes.keys = shapes.values = nullptr;
      shapes.key_lengths = c.visibility.key_lengths.empty() ? nullptr : key_lengths.data();
      shapes.query_lengths = c.visibility.query_lengths.empty() ? nullptr : query_lengths.data();
      shapes.query_positions =
          c.visibility.query_positions.empty() ? nullptr : query_positions.data();
      const cuda::AttentionPlan<T> plan(shapes, where, options);
      EXPECT_EQ(plan.route().kernel, tensor_cores ? Kernel::cuda_tensor_cores : Kernel::cuda_fused);
      if (c.name == "few_queries_many_keys_split" && tensor_cores) {
        EXPECT_GT(plan.key_splits(), 1);
      }
      cuda::DeviceBuffer<unsigned char> workspace(std::max<std::size_t>(plan.workspace_size(), 1));

      for (int run = 0; run < 2; ++run) {
        SCOPED_TRACE("run " + std::to_string(run));
        std::mt19937 random(29u + static_cast<unsigned>(run * 1000 + c.keys));
        const std::vector<T> Q =
            random_stored<T>(static_cast<std::size_t>(B * Hq * Nq * r), random);
        const std::vector<T> K =
            random_stored<T>(static_cast<std::size_t>(B * Hkv * Nk * r), random);
        const std::vector<T> V =
            random_stored<T>(static_cast<std::size_t>(B * Hkv * Nk * rv), random);
        SdpaInput<T> host = input_of(c, Q, K, V);
        host.scale = run == 0 ? c.scale : 0.25;
        std::vector<T> O(rows * static_cast<std::size_t>(rv));
        std::vector<float> lse(rows), H(rows);
        sdpa_attend(host, SdpaOutput<T>{O.data(), lse.data(), H.data()},
                    ExecutionOptions{Device::cuda, 0, precision});

        const auto dQ = on_device(Q, s), dK = on_device(K, s), dV = on_device(V, s);
        SdpaInput<T> device = shapes;
        device.queries = dQ.data();
        device.keys = dK.data();
        device.values = dV.data();
        device.scale = host.scale;
        ASSERT_TRUE(plan.matches(device, where));
        ASSERT_EQ(plan.workspace_size(), cuda::sdpa_workspace_size(device, where, options));
        // NaN everywhere (all bits set) before the run.
        ASSERT_EQ(cudaMemsetAsync(out.data(), 0xFF, out.bytes(), s), cudaSuccess);
        ASSERT_EQ(cudaMemsetAsync(out_lse.data(), 0xFF, out_lse.bytes(), s), cudaSuccess);
        ASSERT_EQ(cudaMemsetAsync(out_entropy.data(), 0xFF, out_entropy.bytes(), s), cudaSuccess);
        plan.run(device, where, workspace.data(), workspace.bytes(), s);
        EXPECT_EQ(bits_of(to_host(out, s)), bits_of(O)) << "output";
        EXPECT_EQ(bits_of(to_host(out_lse, s)), bits_of(lse)) << "lse";
        EXPECT_EQ(bits_of(to_host(out_entropy, s)), bits_of(H)) << "entropy";
        // Something was computed: a finite lse and a nonzero output somewhere.
        EXPECT_TRUE(std::any_of(lse.begin(), lse.end(), [](float v) { return std::isfinite(v); }));
        EXPECT_TRUE(std::any_of(O.begin(), O.end(), [](T v) { return stored_value(v) != 0.0; }));
      }

      // matches(): another shape, or lse not asked for, is another plan's call.
      SdpaInput<T> other = shapes;
      other.query_tokens = Nq + 1;
      EXPECT_FALSE(plan.matches(other, where));
      EXPECT_FALSE(plan.matches(shapes, SdpaOutput<T>{out.data(), nullptr, out_entropy.data()}));
    }
  }
}

// What an SDPA plan refuses, by name: a call that is not its plan's (another shape, an output not
// asked for at planning, an attention layer's input, the other pass; for the backward an upstream
// gradient not given at planning), storage the GPU does not compute
// (can_implement says why without throwing); and a plan that needs no workspace runs with none.
TEST(SdpaCudaPlan, RefusesCallsThatAreNotItsOwnAndRunsWithoutAWorkspaceWhenItNeedsNone) {
  EMFLOW_REQUIRE_CUDA();
  const std::int64_t N = 16, r = 16;
  std::mt19937 random(5u);
  const std::vector<bfloat16> host = random_stored<bfloat16>(N * r, random);
  const auto on = on_device(host, nullptr);
  cuda::DeviceBuffer<bfloat16> out(N * r);
  cuda::DeviceBuffer<float> lse(N);
  SdpaInput<bfloat16> in;
  in.queries = in.keys = in.values = on.data();
  in.query_tokens = in.tokens = N;
  in.rank = in.value_rank = r;
  in.mask = Mask::causal();
  const SdpaOutput<bfloat16> where{out.data(), lse.data()};
  const cuda::AttentionPlan<bfloat16> plan(in, where);
  cuda::DeviceBuffer<unsigned char> workspace(plan.workspace_size());
  SdpaInput<bfloat16> fewer = in;
  fewer.query_tokens = N - 1;
  EXPECT_TRUE(throws_error(
      [&] { plan.run(fewer, where, workspace.data(), workspace.bytes(), nullptr); },
      ErrorCode::invalid_argument, {"cuda::AttentionPlan", "'query_tokens'", "15", "16"}));
  SdpaInput<bfloat16> unmasked = in;
  unmasked.mask = Mask::none();
  EXPECT_TRUE(
      throws_error([&] { plan.run(unmasked, where, workspace.data(), workspace.bytes(), nullptr); },
                   ErrorCode::invalid_argument, {"'mask'", "causal"}));
  EXPECT_TRUE(throws_error(
      [&] {
        plan.run(in, SdpaOutput<bfloat16>{out.data()}, workspace.data(), workspace.bytes(),
                 nullptr);
      },
      ErrorCode::invalid_argument, {"'lse'", "null", "given"}));
  AttentionInput<bfloat16> layer_input;
  AttentionOutput<bfloat16> layer_output;
  EXPECT_TRUE(throws_error(
      [&] { plan.run(layer_input, layer_output, workspace.data(), workspace.bytes(), nullptr); },
      ErrorCode::invalid_argument, {"'input'", "SdpaInput"}));
  EXPECT_TRUE(
      throws_error([&] { plan.run(in, where, workspace.data(), workspace.bytes() - 1, nullptr); },
                   ErrorCode::invalid_argument, {"'workspace_bytes'"}));
  EXPECT_FALSE(plan.matches(fewer, where));

  // The backward's plan, made for dO and lse's gradient: the forward's call, or dH given, are
  // not its calls; the forward's plan refuses the backward's call.
  cuda::DeviceBuffer<bfloat16> dO(N * r), dQ(N * r), dK(N * r), dV(N * r);
  cuda::DeviceBuffer<float> dlse(N), dH(N), entropy(N);
  const UpstreamGradients<bfloat16> upstream{dO.data(), dlse.data()};
  const SdpaGradientOutput<bfloat16> gradients{dQ.data(), dK.data(), dV.data()};
  const SdpaSaved<bfloat16> saved{out.data(), lse.data(), entropy.data()};
  const cuda::AttentionPlan<bfloat16> backward(in, upstream, gradients);
  cuda::DeviceBuffer<unsigned char> backward_workspace(backward.workspace_size());
  EXPECT_TRUE(throws_error(
      [&] {
        backward.run(in, saved, UpstreamGradients<bfloat16>{dO.data(), dlse.data(), dH.data()},
                     gradients, backward_workspace.data(), backward_workspace.bytes(), nullptr);
      },
      ErrorCode::invalid_argument, {"'upstream.entropy'", "given", "null"}));
  EXPECT_TRUE(
      throws_error([&] { backward.run(in, where, workspace.data(), workspace.bytes(), nullptr); },
                   ErrorCode::invalid_argument, {"'plan'", "backward pass"}));
  EXPECT_TRUE(throws_error(
      [&] {
        plan.run(in, saved, upstream, gradients, backward_workspace.data(),
                 backward_workspace.bytes(), nullptr);
      },
      ErrorCode::invalid_argument, {"'plan'", "forward pass"}));
  EXPECT_TRUE(backward.matches(in, saved, upstream, gradients));
  EXPECT_FALSE(backward.matches(fewer, saved, upstream, gradients));
  EXPECT_EQ(backward.workspace_size(), cuda::sdpa_backward_workspace_size(in, upstream, gradients));

  // float64: no GPU kernel; can_implement says so without throwing, the constructor throws it.
  SdpaInput<double> wide;
  wide.query_tokens = wide.tokens = N;
  wide.rank = wide.value_rank = r;
  double dummy = 0.0;
  const Route refused =
      cuda::AttentionPlan<double>::can_implement(wide, SdpaOutput<double>{&dummy});
  EXPECT_FALSE(refused.supported);
  EXPECT_NE(refused.reason.find("float64"), std::string::npos) << refused.reason;
  EXPECT_TRUE(throws_error([&] { cuda::AttentionPlan<double> p(wide, SdpaOutput<double>{&dummy}); },
                           ErrorCode::unsupported, {"float64"}));

  // Float with Precision::fp32 and lse asked for: the float32 kernel needs no workspace, and the
  // plan runs with none; its output is the one-call form's.
  std::vector<float> q(N * r);
  std::uniform_real_distribution<float> uniform(-1.f, 1.f);
  for (float& v : q) v = uniform(random);
  const auto fq = on_device(q, nullptr);
  SdpaInput<float> fp32;
  fp32.queries = fp32.keys = fp32.values = fq.data();
  fp32.query_tokens = fp32.tokens = N;
  fp32.rank = fp32.value_rank = r;
  cuda::DeviceBuffer<float> f_out(N * r), f_lse(N), g_out(N * r), g_lse(N);
  const cuda::AttentionPlan<float> none(fp32, SdpaOutput<float>{f_out.data(), f_lse.data()});
  EXPECT_EQ(none.workspace_size(), 0u);
  EXPECT_EQ(none.route().kernel, Kernel::cuda_fused);
  none.run(fp32, SdpaOutput<float>{f_out.data(), f_lse.data()}, nullptr, 0, nullptr);
  cuda::sdpa_attend_async(fp32, SdpaOutput<float>{g_out.data(), g_lse.data()}, nullptr, 0, nullptr);
  const std::vector<float> planned = to_host(f_out, nullptr), one_call = to_host(g_out, nullptr);
  EXPECT_EQ(bits_of(planned), bits_of(one_call));
  EXPECT_TRUE(std::any_of(planned.begin(), planned.end(), [](float v) { return v != 0.f; }));
}

// What the stream-ordered forms refuse, by name: host arrays, a short workspace, float without
// TF32 on the forward's tensor cores, a rank beyond the backward's kernels.
TEST(SdpaCudaAsync, RefusesHostArraysShortWorkspacesAndWhatNoKernelComputes) {
  EMFLOW_REQUIRE_CUDA();
  const std::int64_t N = 16, r = 16;
  std::mt19937 random(3u);
  const std::vector<bfloat16> host = random_stored<bfloat16>(N * r, random);
  const auto on = on_device(host, nullptr);
  cuda::DeviceBuffer<bfloat16> out(N * r);
  SdpaInput<bfloat16> in;
  in.queries = in.keys = in.values = on.data();
  in.query_tokens = in.tokens = N;
  in.rank = in.value_rank = r;
  const SdpaOutput<bfloat16> where{out.data()};
  const std::size_t bytes = cuda::sdpa_workspace_size(in, where);
  cuda::DeviceBuffer<unsigned char> workspace(bytes + 256);
  SdpaInput<bfloat16> from_host = in;
  from_host.keys = host.data();
  EXPECT_TRUE(throws_error(
      [&] { cuda::sdpa_attend_async(from_host, where, workspace.data(), bytes, nullptr); },
      ErrorCode::invalid_argument, {"sdpa_attend_async", "'keys'"}));
  if (bytes > 0) {
    EXPECT_TRUE(throws_error(
        [&] { cuda::sdpa_attend_async(in, where, workspace.data(), bytes - 1, nullptr); },
        ErrorCode::invalid_argument, {"sdpa_attend_async", "workspace"}));
  }
  const std::vector<float> wide(N * r, 0.5f);
  const auto wide_on = on_device(wide, nullptr);
  cuda::DeviceBuffer<float> wide_out(N * r);
  SdpaInput<float> fp32;
  fp32.queries = fp32.keys = fp32.values = wide_on.data();
  fp32.query_tokens = fp32.tokens = N;
  fp32.rank = fp32.value_rank = r;
  // Float with Precision::fp32: the float32 kernel, whose workspace is lse's rows when lse is
  // not asked for (16 floats, one 256-byte piece), none when it is.
  EXPECT_EQ(cuda::sdpa_workspace_size(fp32, SdpaOutput<float>{wide_out.data()}), 256u);
  cuda::DeviceBuffer<float> wide_lse(N);
  EXPECT_EQ(cuda::sdpa_workspace_size(fp32, SdpaOutput<float>{wide_out.data(), wide_lse.data()}),
            0u);
  SdpaInput<float> too_wide = fp32;
  too_wide.rank = too_wide.value_rank = 130;
  too_wide.query_tokens = too_wide.tokens = 1;
  float dq = 0.f;
  EXPECT_TRUE(throws_error([&] { cuda::sdpa_workspace_size(too_wide, SdpaOutput<float>{&dq}); },
                           ErrorCode::unsupported,
                           {"sdpa_workspace_size", "float32 SDPA", "128", "130"}));
  EXPECT_TRUE(throws_error(
      [&] {
        cuda::sdpa_backward_workspace_size(too_wide, UpstreamGradients<float>{},
                                           SdpaGradientOutput<float>{&dq, &dq, &dq});
      },
      ErrorCode::unsupported, {"sdpa_backward_workspace_size", "128"}));
}

}  // namespace
}  // namespace emflow::testing

#endif
