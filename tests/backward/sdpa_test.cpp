// The SDPA-shaped operator (include/emflow/sdpa.hpp), forward and backward, on every host target
// (targets.hpp) against the double reference (reference::sdpa_attend, reference::sdpa_backward),
// through each upstream gradient alone and all of them; the exact zeros of queries without keys
// and of keys that no query sees, with NaN in their upstream gradients and in the padding rows of
// the inputs; the bitwise independence of the thread count; and the refusals, by name.
//
// Bounds. Double: 1e-12 relative (double on both devices is the reference, or the reference
// rounded once). Float: 1e-5 relative, the forward's bound (docs/MATH.md §6.3), over each array
// (||a - b|| / ||b||). The float kernels round every product term once (float32 accumulation over
// at most Nk + Nq terms of sizes set by scores of order 1 to 3): about 1e-7 sqrt(N) per
// accumulated value, and dS = P (dP - E) loses up to the ratio |dP| / |dP - E| where dP and E
// nearly cancel, which random upstream gradients keep small; measured, the largest error of any
// gradient over these cases is about 1e-6, ten times under the bound, while a wrong term (a
// missing head of a group, a masked pair, a missed span) moves a gradient by 1e-2 or more.
// dL/dscale sums terms of both signs; it is held to the bound times the size of its terms,
// ||dQ|| ||Q|| / |scale| (Cauchy-Schwarz on sum_i <dq_i, q_i> = scale dscale).
#include "emflow/sdpa.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "backward/targets.hpp"
#include "common/accuracy.hpp"
#include "common/sdpa_case.hpp"
#include "common/stored.hpp"
#include "common/testing.hpp"
#include "emflow/capability.hpp"
#include "emflow/precision.hpp"
#include "emflow/reference.hpp"

namespace emflow {
namespace {

using reference::Visibility;
using testing::HostTarget;
using testing::input_of;
using testing::round_trip;
using testing::SdpaCase;
using testing::Through;

Visibility masked(Mask mask) {
  Visibility v;
  v.mask = mask;
  return v;
}

Visibility with_lengths(Mask mask, std::vector<std::int64_t> keys,
                        std::vector<std::int64_t> queries) {
  Visibility v = masked(mask);
  v.key_lengths = std::move(keys);
  v.query_lengths = std::move(queries);
  return v;
}

Visibility at_positions(Mask mask, std::int64_t key_position,
                        std::vector<std::int64_t> query_positions) {
  Visibility v = masked(mask);
  v.key_position = key_position;
  v.query_positions = std::move(query_positions);
  return v;
}

// Shapes that leave part of a 64-row block, of a 64-key block and of a vector empty, with
// several blocks (and several spans of key blocks) where it matters.
std::vector<SdpaCase> sdpa_cases() {
  return {
      {"h6_kv2_none", 2, 6, 2, 70, 70, 5, 3, masked(Mask::none())},
      {"h6_kv1_causal", 1, 6, 1, 130, 130, 16, 9, masked(Mask::causal())},
      {"h6_kv2_window", 1, 6, 2, 100, 100, 8, 8, masked(Mask::sliding_window(20))},
      {"h2_causal_lengths_padding_empty", 3, 2, 2, 77, 77, 7, 5,
       with_lengths(Mask::causal(), {77, 40, 0}, {77, 40, 0})},
      {"h2_kv1_none_lengths", 2, 2, 1, 66, 66, 3, 4, with_lengths(Mask::none(), {50, 3}, {66, 2})},
      // Cross-attention at explicit positions: cloud 0's first queries sit before every key.
      {"h6_kv2_cross_causal_positions", 2, 6, 2, 30, 140, 12, 6,
       at_positions(Mask::causal(), 4, {-10, 100}), 1.1},
      {"h4_kv2_cross_window_positions", 2, 4, 2, 40, 90, 6, 6,
       at_positions(Mask::sliding_window(25), -2, {1, 60})},
      // Cross-attention aligned bottom-right, with key and query lengths.
      {"h6_kv1_cross_window_lengths", 2, 6, 1, 20, 150, 4, 7,
       with_lengths(Mask::sliding_window(30), {150, 70}, {20, 9})},
      {"h3_negative_scale", 1, 3, 3, 40, 50, 9, 5, masked(Mask::none()), -1.3},
      {"h2_kv1_value_rank_above_rank", 1, 2, 1, 45, 45, 3, 33, masked(Mask::causal())},
      {"h1_one_key", 2, 1, 1, 3, 1, 4, 4, masked(Mask::none())},
      {"h1_r64_several_spans", 1, 1, 1, 300, 300, 64, 64, masked(Mask::causal()), 0.125},
  };
}

/// One case's inputs (float-exact), NaN in the padding rows (which no target may read).
struct Inputs {
  Tensor<double> Q, K, V;
  Shape output, statistics;

  Inputs(const SdpaCase& c, std::uint64_t seed) {
    Q = testing::float_exact(
        testing::random_tensor({c.batch, c.query_heads, c.queries, c.rank}, seed * 5 + 1));
    K = testing::float_exact(
        testing::random_tensor({c.batch, c.kv_heads, c.keys, c.rank}, seed * 5 + 2));
    V = testing::float_exact(
        testing::random_tensor({c.batch, c.kv_heads, c.keys, c.value_rank}, seed * 5 + 3));
    output = {c.batch, c.query_heads, c.queries, c.value_rank};
    statistics = {c.batch, c.query_heads, c.queries};
    const Visibility& v = c.visibility;
    for (std::int64_t b = 0; b < c.batch; ++b) {
      const std::int64_t Lk = v.key_lengths.empty() ? c.keys : v.key_lengths[b];
      const std::int64_t Lq = v.query_lengths.empty() ? c.queries : v.query_lengths[b];
      for (std::int64_t h = 0; h < c.query_heads; ++h) {
        for (std::int64_t i = Lq; i < c.queries; ++i) {
          for (std::int64_t a = 0; a < c.rank; ++a) {
            Q[((b * c.query_heads + h) * c.queries + i) * c.rank + a] = testing::kNaN;
          }
        }
      }
      for (std::int64_t g = 0; g < c.kv_heads; ++g) {
        for (std::int64_t j = Lk; j < c.keys; ++j) {
          for (std::int64_t a = 0; a < c.rank; ++a) {
            K[((b * c.kv_heads + g) * c.keys + j) * c.rank + a] = testing::kNaN;
          }
          for (std::int64_t a = 0; a < c.value_rank; ++a) {
            V[((b * c.kv_heads + g) * c.keys + j) * c.value_rank + a] = testing::kNaN;
          }
        }
      }
    }
  }
};

std::int64_t count(const Shape& shape) {
  std::int64_t n = 1;
  for (std::int64_t e : shape) n *= e;
  return n;
}

/// The SdpaInput of a case over arrays of T.
/// Random upstream gradients through `through`, NaN on the rows of queries without keys.
reference::OutputGradients upstream_of(Through through, const Inputs& in, const Tensor<double>& lse,
                                       std::uint64_t seed) {
  const std::vector<bool> sees = testing::rows_with_keys(lse);
  reference::OutputGradients up;
  if (testing::with_update(through)) {
    up.update =
        testing::nan_rows(testing::float_exact(testing::random_tensor(in.output, seed * 3 + 1)),
                          in.output.back(), sees);
  }
  if (testing::with_lse(through)) {
    up.lse = testing::nan_rows(
        testing::float_exact(testing::random_tensor(in.statistics, seed * 3 + 2)), 1, sees);
  }
  if (testing::with_entropy(through)) {
    up.entropy = testing::nan_rows(
        testing::float_exact(testing::random_tensor(in.statistics, seed * 3 + 3)), 1, sees);
  }
  return up;
}

/// The size of the terms of dL/dscale = sum_i <dq_i, q_i> / scale over the queries with keys:
/// ||dQ|| ||Q|| / |scale| on those rows (the others hold NaN padding).
double scale_magnitude(const Tensor<double>& dQ, const Tensor<double>& Q,
                       const std::vector<bool>& sees, const SdpaCase& c) {
  double dq2 = 0.0, q2 = 0.0;
  for (std::size_t row = 0; row < sees.size(); ++row) {
    if (!sees[row]) continue;
    for (std::int64_t a = 0; a < c.rank; ++a) {
      const std::int64_t e = static_cast<std::int64_t>(row) * c.rank + a;
      dq2 += dQ[e] * dQ[e];
      q2 += Q[e] * Q[e];
    }
  }
  return std::sqrt(dq2 * q2) / std::abs(c.scale);
}

class SdpaBackward : public ::testing::TestWithParam<std::tuple<HostTarget, SdpaCase>> {};

TEST_P(SdpaBackward, ForwardAndGradientsMatchTheReference) {
  const HostTarget& target = std::get<0>(GetParam());
  const SdpaCase& c = std::get<1>(GetParam());
  const Inputs in(c, 17);
  const Visibility& v = c.visibility;
  const reference::SdpaAttention ref =
      reference::sdpa_attend(in.Q, in.K, in.V, c.scale, v, /*with_weights=*/true);
  const std::vector<bool> sees = testing::rows_with_keys(ref.lse);
  // Keys some query of the group sees: a positive weight somewhere in their column.
  std::vector<bool> unseen(static_cast<std::size_t>(c.batch * c.kv_heads * c.keys), true);
  for (std::int64_t b = 0; b < c.batch; ++b) {
    for (std::int64_t h = 0; h < c.query_heads; ++h) {
      const std::int64_t g = h / (c.query_heads / c.kv_heads);
      for (std::int64_t i = 0; i < c.queries; ++i) {
        for (std::int64_t j = 0; j < c.keys; ++j) {
          if (ref.weights[((b * c.query_heads + h) * c.queries + i) * c.keys + j] > 0) {
            unseen[static_cast<std::size_t>((b * c.kv_heads + g) * c.keys + j)] = false;
          }
        }
      }
    }
  }

  testing::in_precision(target.is_double, [&](auto zero) {
    using T = decltype(zero);
    const double tol = target.tolerance();
    const ExecutionOptions options{target.device, target.threads};
    const std::vector<T> Q = testing::as_vector<T>(in.Q), K = testing::as_vector<T>(in.K),
                         V = testing::as_vector<T>(in.V);
    const SdpaInput<T> input = input_of(c, Q, K, V);
    std::vector<T> O = testing::poisoned<T>(ref.output.size()),
                   lse = testing::poisoned<T>(ref.lse.size()),
                   H = testing::poisoned<T>(ref.lse.size());
    sdpa_attend(input, SdpaOutput<T>{O.data(), lse.data(), H.data()}, options);
    EXPECT_TRUE(testing::close_to(O, ref.output.values(), tol)) << "output";
    EXPECT_TRUE(testing::close_to(lse, ref.lse.values(), tol)) << "lse";
    EXPECT_TRUE(testing::close_to(H, ref.entropy.values(), tol)) << "entropy";

    for (Through through : testing::kEveryThrough) {
      SCOPED_TRACE(testing::to_string(through));
      const reference::OutputGradients up = upstream_of(through, in, ref.lse, 23);
      const reference::SdpaGradients expected =
          reference::sdpa_backward(in.Q, in.K, in.V, c.scale, v, up);
      const std::vector<T> dO = testing::as_vector<T>(up.update),
                           dlse = testing::as_vector<T>(up.lse),
                           dH = testing::as_vector<T>(up.entropy);
      UpstreamGradients<T> upstream;
      upstream.update = dO.empty() ? nullptr : dO.data();
      upstream.lse = dlse.empty() ? nullptr : dlse.data();
      upstream.entropy = dH.empty() ? nullptr : dH.data();
      std::vector<T> dQ = testing::poisoned<T>(in.Q.size()), dK = testing::poisoned<T>(in.K.size()),
                     dV = testing::poisoned<T>(in.V.size());
      double dscale = testing::kNaN;
      sdpa_backward(input, SdpaSaved<T>{O.data(), lse.data(), H.data()}, upstream,
                    SdpaGradientOutput<T>{dQ.data(), dK.data(), dV.data(), &dscale}, options);
      EXPECT_TRUE(testing::close_to(dQ, expected.queries.values(), tol)) << "dQ";
      EXPECT_TRUE(testing::close_to(dK, expected.keys.values(), tol)) << "dK";
      EXPECT_TRUE(testing::close_to(dV, expected.values.values(), tol)) << "dV";
      EXPECT_TRUE(testing::scalar_close(dscale, expected.scale,
                                        scale_magnitude(expected.queries, in.Q, sees, c), tol))
          << "dscale";
      // Queries without keys, and keys that no query sees, get exact zeros: nothing reached
      // them, not even the NaN upstream gradients of those queries or the NaN padding.
      std::vector<bool> no_keys(sees.size());
      for (std::size_t e = 0; e < sees.size(); ++e) no_keys[e] = !sees[e];
      EXPECT_TRUE(testing::zero_rows(dQ, c.rank, no_keys)) << "dQ";
      EXPECT_TRUE(testing::zero_rows(dK, c.rank, unseen)) << "dK";
      EXPECT_TRUE(testing::zero_rows(dV, c.value_rank, unseen)) << "dV";
    }
  });
}

std::string case_name(const ::testing::TestParamInfo<std::tuple<HostTarget, SdpaCase>>& info) {
  return std::get<0>(info.param).name() + "_" + std::get<1>(info.param).name;
}

INSTANTIATE_TEST_SUITE_P(Cases, SdpaBackward,
                         ::testing::Combine(::testing::ValuesIn(testing::host_targets()),
                                            ::testing::ValuesIn(sdpa_cases())),
                         case_name);

// ---------------------------------------------------------------------------------------------
// Determinism: the CPU at 1, 2 and 3 threads, bit for bit.

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

TEST(SdpaDeterminism, GradientsAreBitwiseTheSameForOneTwoAndThreeThreads) {
  // Several query blocks, key blocks and spans of key blocks, grouped heads, a causal mask with
  // lengths; and a few queries against many keys, where the forward splits the keys.
  const std::vector<SdpaCase> cases = {
      {"blocks_and_spans", 2, 4, 2, 333, 333, 40, 24,
       with_lengths(Mask::causal(), {333, 200}, {333, 200})},
      {"split_keys", 1, 2, 1, 5, 5000, 16, 16, masked(Mask::none())},
  };
  for (const SdpaCase& c : cases) {
    SCOPED_TRACE(c.name);
    const Inputs in(c, 5);
    const std::vector<float> Q = testing::as_vector<float>(in.Q),
                             K = testing::as_vector<float>(in.K),
                             V = testing::as_vector<float>(in.V);
    const SdpaInput<float> input = input_of(c, Q, K, V);
    std::vector<float> O1, lse1, H1, dQ1, dK1, dV1;
    double dscale1 = 0;
    for (int threads : {1, 2, 3}) {
      std::vector<float> O = testing::poisoned<float>(count(in.output)),
                         lse = testing::poisoned<float>(count(in.statistics)),
                         H = testing::poisoned<float>(count(in.statistics));
      const ExecutionOptions options{Device::cpu, threads};
      sdpa_attend(input, SdpaOutput<float>{O.data(), lse.data(), H.data()}, options);
      const reference::SdpaAttention ref =
          reference::sdpa_attend(in.Q, in.K, in.V, c.scale, c.visibility);
      const reference::OutputGradients up = upstream_of(Through::all, in, ref.lse, 9);
      const std::vector<float> dO = testing::as_vector<float>(up.update),
                               dlse = testing::as_vector<float>(up.lse),
                               dH = testing::as_vector<float>(up.entropy);
      std::vector<float> dQ = testing::poisoned<float>(in.Q.size()),
                         dK = testing::poisoned<float>(in.K.size()),
                         dV = testing::poisoned<float>(in.V.size());
      double dscale = testing::kNaN;
      sdpa_backward(input, SdpaSaved<float>{O.data(), lse.data(), H.data()},
                    UpstreamGradients<float>{dO.data(), dlse.data(), dH.data()},
                    SdpaGradientOutput<float>{dQ.data(), dK.data(), dV.data(), &dscale}, options);
      if (threads == 1) {
        O1 = O, lse1 = lse, H1 = H, dQ1 = dQ, dK1 = dK, dV1 = dV, dscale1 = dscale;
        continue;
      }
      SCOPED_TRACE(threads);
      EXPECT_TRUE(same_bits(O, O1) && same_bits(lse, lse1) && same_bits(H, H1));
      EXPECT_TRUE(same_bits(dQ, dQ1)) << "dQ";
      EXPECT_TRUE(same_bits(dK, dK1)) << "dK";
      EXPECT_TRUE(same_bits(dV, dV1)) << "dV";
      EXPECT_TRUE(std::memcmp(&dscale, &dscale1, sizeof dscale) == 0) << "dscale";
    }
  }
}

// ---------------------------------------------------------------------------------------------
// bfloat16 and float16 storage (docs/MATH.md §8.8): the accuracy rule of §7.4 on the output and
// each gradient (max error against the double reference of the stored values at most twice a
// naive kernel's), with the naive backward of tests/common/sdpa_case.hpp. It reads what a 16-bit
// kernel reads: the stored Q, K, V and dO, the forward's lse and H (float32) and its O (stored,
// rounded); it computes the scores, the weights p_ij = exp(s_ij - lse_i) and dS_ij in double,
// rounds P and dS to the storage type before the products that read them (dV = P^T dO, dK = scale
// dS^T Q, dQ = scale dS K, summed in double), and rounds the gradients once. On a processor with
// AVX512-BF16 bfloat16 runs that kernel's products (the test says which path ran);
// EMFLOW_CPU_DISABLE=avx512bf16 sends it to the widening float32 kernel, which ctest runs too
// (backward.bf16_widened).

/// Every value of `t` rounded to T and read back: inputs T holds exactly.
template <class T>
Tensor<double> rounded(Tensor<double> t) {
  for (double& v : t.values()) v = round_trip<T>(v);
  return t;
}

/// What the forward pass leaves for the backward: O stored as T, lse and H in float32.
template <class T>
struct Saved {
  std::vector<T> output;
  std::vector<float> lse, entropy;
};

/// `t`'s values, with 0 in place of NaN (the padding rows, whose gradients are exactly 0).
std::vector<double> zero_padding(const Tensor<double>& t) {
  std::vector<double> out(t.values().begin(), t.values().end());
  for (double& v : out) v = std::isnan(v) ? 0.0 : v;
  return out;
}

template <class T>
class SdpaLowPrecision : public ::testing::Test {};
using StorageTypes = ::testing::Types<bfloat16, float16>;
TYPED_TEST_SUITE(SdpaLowPrecision, StorageTypes);

TYPED_TEST(SdpaLowPrecision, GradientsMeetTheAccuracyRule) {
  using T = TypeParam;
  if (std::is_same_v<T, bfloat16>) {
    std::cout << "[path] bfloat16 backward: "
              << (this_machine().avx512_bf16 ? "AVX512-BF16 products"
                                             : "widened to the float32 kernel (no AVX512-BF16, "
                                               "or EMFLOW_CPU_DISABLE names it)")
              << std::endl;
  }
  const char* names[] = {"dQ", "dK", "dV"};
  double worst[] = {0.0, 0.0, 0.0};
  for (const SdpaCase& c : sdpa_cases()) {
    SCOPED_TRACE(c.name);
    Inputs in(c, 29);
    in.Q = rounded<T>(in.Q);
    in.K = rounded<T>(in.K);
    in.V = rounded<T>(in.V);
    const reference::SdpaAttention ref =
        reference::sdpa_attend(in.Q, in.K, in.V, c.scale, c.visibility, /*with_weights=*/true);
    const std::vector<T> Q = testing::stored<T>(in.Q.values()),
                         K = testing::stored<T>(in.K.values()),
                         V = testing::stored<T>(in.V.values());
    const SdpaInput<T> input = input_of(c, Q, K, V);
    Saved<T> saved{std::vector<T>(static_cast<std::size_t>(count(in.output))),
                   std::vector<float>(static_cast<std::size_t>(count(in.statistics))),
                   std::vector<float>(static_cast<std::size_t>(count(in.statistics)))};
    const ExecutionOptions options{Device::cpu, 2};
    sdpa_attend(input, SdpaOutput<T>{saved.output.data(), saved.lse.data(), saved.entropy.data()},
                options);
    // The forward pass under the rule of §7.4: the naive output sums P rounded to T times V.
    std::vector<double> naive_output(static_cast<std::size_t>(count(in.output)), 0.0);
    for (std::int64_t row = 0; row < count(in.statistics); ++row) {
      const std::int64_t set = (row / (c.query_heads * c.queries)) * c.kv_heads +
                               (row / c.queries) % c.query_heads / (c.query_heads / c.kv_heads);
      for (std::int64_t j = 0; j < c.keys; ++j) {
        const double p = ref.weights[row * c.keys + j];
        if (!(p > 0.0)) continue;
        for (std::int64_t a = 0; a < c.value_rank; ++a) {
          naive_output[static_cast<std::size_t>(row * c.value_rank + a)] +=
              round_trip<T>(p) * in.V[(set * c.keys + j) * c.value_rank + a];
        }
      }
    }
    for (double& o : naive_output) o = round_trip<T>(o);
    EXPECT_EQ(testing::check_rule("output", testing::values_of(saved.output), naive_output,
                                  zero_padding(ref.output)),
              "");
    for (Through through : testing::kEveryThrough) {
      SCOPED_TRACE(testing::to_string(through));
      reference::OutputGradients up = upstream_of(through, in, ref.lse, 31);
      if (up.update.size() != 0) up.update = rounded<T>(up.update);
      const std::vector<T> dO = testing::stored<T>(up.update.values());
      const std::vector<float> dlse = testing::as_vector<float>(up.lse),
                               dH = testing::as_vector<float>(up.entropy);
      UpstreamGradients<T> upstream;
      upstream.update = dO.empty() ? nullptr : dO.data();
      upstream.lse = dlse.empty() ? nullptr : dlse.data();
      upstream.entropy = dH.empty() ? nullptr : dH.data();
      std::vector<T> dQ(static_cast<std::size_t>(in.Q.size()), testing::stored<T>(testing::kNaN)),
          dK(static_cast<std::size_t>(in.K.size()), testing::stored<T>(testing::kNaN)),
          dV(static_cast<std::size_t>(in.V.size()), testing::stored<T>(testing::kNaN));
      sdpa_backward(input,
                    SdpaSaved<T>{saved.output.data(), saved.lse.data(), saved.entropy.data()},
                    upstream, SdpaGradientOutput<T>{dQ.data(), dK.data(), dV.data()}, options);
      const reference::SdpaGradients exact =
          reference::sdpa_backward(in.Q, in.K, in.V, c.scale, c.visibility, up);
      const testing::NaiveGradients naive =
          testing::naive_sdpa_backward<T>(c, in.Q, in.K, in.V, ref.weights, saved.output.data(),
                                          saved.lse.data(), saved.entropy.data(), up);
      const std::vector<double> ours[] = {testing::values_of(dQ), testing::values_of(dK),
                                          testing::values_of(dV)};
      const std::vector<double>* naives[] = {&naive.queries, &naive.keys, &naive.values};
      const std::vector<double> exacts[] = {zero_padding(exact.queries), zero_padding(exact.keys),
                                            zero_padding(exact.values)};
      for (int e = 0; e < 3; ++e) {
        EXPECT_EQ(testing::check_rule(names[e], ours[e], *naives[e], exacts[e]), "");
        const double naive_error = testing::max_error(*naives[e], exacts[e]);
        if (naive_error > 0) {
          worst[e] = std::max(worst[e], testing::max_error(ours[e], exacts[e]) / naive_error);
        }
      }
    }
  }
  // How close the kernel comes to the bound, for the record (the rule allows 2).
  for (int e = 0; e < 3; ++e) {
    std::cout << "[margin] " << (std::is_same_v<T, bfloat16> ? "bfloat16 " : "float16 ") << names[e]
              << ": largest error / naive error " << worst[e] << std::endl;
  }
}

TYPED_TEST(SdpaLowPrecision,
           GradientsAreBitwiseTheSameForOneTwoAndThreeThreadsAndTheRuleRejectsZeros) {
  using T = TypeParam;
  const SdpaCase c{"blocks_and_spans",
                   2,
                   4,
                   2,
                   333,
                   333,
                   40,
                   24,
                   with_lengths(Mask::causal(), {333, 200}, {333, 200})};
  Inputs in(c, 7);
  in.Q = rounded<T>(in.Q);
  in.K = rounded<T>(in.K);
  in.V = rounded<T>(in.V);
  const std::vector<T> Q = testing::stored<T>(in.Q.values()), K = testing::stored<T>(in.K.values()),
                       V = testing::stored<T>(in.V.values());
  const SdpaInput<T> input = input_of(c, Q, K, V);
  Saved<T> saved{std::vector<T>(static_cast<std::size_t>(count(in.output))),
                 std::vector<float>(static_cast<std::size_t>(count(in.statistics))),
                 std::vector<float>(static_cast<std::size_t>(count(in.statistics)))};
  sdpa_attend(input, SdpaOutput<T>{saved.output.data(), saved.lse.data(), saved.entropy.data()},
              ExecutionOptions{Device::cpu, 1});
  const reference::SdpaAttention ref =
      reference::sdpa_attend(in.Q, in.K, in.V, c.scale, c.visibility);
  reference::OutputGradients up = upstream_of(Through::all, in, ref.lse, 3);
  up.update = rounded<T>(up.update);
  const std::vector<T> dO = testing::stored<T>(up.update.values());
  const std::vector<float> dlse = testing::as_vector<float>(up.lse),
                           dH = testing::as_vector<float>(up.entropy);
  std::vector<T> dQ1, dK1, dV1;
  for (int threads : {1, 2, 3}) {
    std::vector<T> dQ(static_cast<std::size_t>(in.Q.size())),
        dK(static_cast<std::size_t>(in.K.size())), dV(static_cast<std::size_t>(in.V.size()));
    sdpa_backward(input, SdpaSaved<T>{saved.output.data(), saved.lse.data(), saved.entropy.data()},
                  UpstreamGradients<T>{dO.data(), dlse.data(), dH.data()},
                  SdpaGradientOutput<T>{dQ.data(), dK.data(), dV.data()},
                  ExecutionOptions{Device::cpu, threads});
    if (threads == 1) {
      dQ1 = dQ, dK1 = dK, dV1 = dV;
      // The rule is not met by gradients that are all zero.
      const reference::SdpaGradients exact =
          reference::sdpa_backward(in.Q, in.K, in.V, c.scale, c.visibility, up);
      const std::vector<double> zeros(dQ.size(), 0.0);
      EXPECT_EQ(testing::check_rule("dQ", testing::values_of(dQ), testing::values_of(dQ1),
                                    zero_padding(exact.queries)),
                "");
      EXPECT_NE(
          testing::check_rule("dQ", zeros, testing::values_of(dQ1), zero_padding(exact.queries)),
          "");
      continue;
    }
    SCOPED_TRACE(threads);
    EXPECT_TRUE(same_bits(dQ, dQ1)) << "dQ";
    EXPECT_TRUE(same_bits(dK, dK1)) << "dK";
    EXPECT_TRUE(same_bits(dV, dV1)) << "dV";
  }
}

}  // namespace
}  // namespace emflow
