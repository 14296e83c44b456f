// Rotary positions and grouped kv heads of the factored form (factored.hpp, docs/MATH.md §2.4)
// against a naive test-side computation that builds M_h(Delta) = A_h^T R(Delta) B_h and
// F_h = U_h V_{h/g} explicitly for every pair of positions, on the CPU (float32 engine, double
// reference of the factored form) and on the reference device; the frequencies of each scaling
// against the formulas written out; shift invariance; the equalities with the position-free and
// the repeated layer; the refusals and the argument checks; rotary_drift, the per-offset report of
// a rotary head's form, against those forms built entry by entry.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "common/stored.hpp"
#include "common/testing.hpp"
#include "emflow/backward.hpp"
#include "emflow/capability.hpp"
#include "emflow/decode.hpp"
#include "emflow/error.hpp"
#include "emflow/factored.hpp"

namespace emflow {
namespace {

using testing::stored;
using testing::uniform;
using testing::values_of;

constexpr double kPi = 3.14159265358979323846;

/// A rotary, grouped factored layer on a batch of clouds, its values in double.
struct RotaryProblem {
  std::int64_t batch = 2, tokens = 9, query_tokens = 0, dim = 6, heads = 4, kv_heads = 4;
  std::int64_t rank = 4;
  bool cross = false, bias = true, offset = true, lengths = false;
  double beta = 0.9;
  Mask mask;
  Rotary rotary;
  std::int64_t key_position = 0, query_position = kAlignToEnd;
  std::vector<double> cloud, queries, A, B, U, V, u, c;
  std::vector<std::int64_t> key_lengths, query_lengths;

  std::int64_t Nq() const { return cross ? query_tokens : tokens; }

  void fill(std::uint64_t seed) {
    const auto n = [](std::int64_t x) { return static_cast<std::size_t>(x); };
    const double s = 1.2 / std::sqrt(static_cast<double>(dim));
    cloud = uniform(n(batch * tokens * dim), seed);
    if (cross) queries = uniform(n(batch * query_tokens * dim), seed + 9);
    A = uniform(n(heads * rank * dim), seed + 1, -s, s);
    B = uniform(n(kv_heads * rank * dim), seed + 2, -s, s);
    U = uniform(n(heads * dim * rank), seed + 3, -s, s);
    V = uniform(n(kv_heads * rank * dim), seed + 4, -s, s);
    u = uniform(n(heads * dim), seed + 5, -0.5, 0.5);
    c = uniform(n(dim), seed + 6);
    key_lengths.clear();
    query_lengths.clear();
    if (lengths) {
      for (std::int64_t b = 0; b < batch; ++b) key_lengths.push_back(tokens - 2 * b);
      if (cross) {
        for (std::int64_t b = 0; b < batch; ++b) query_lengths.push_back(query_tokens - b);
      }
    }
  }

  /// The values as T holds them (the naive computation reads these).
  template <class T>
  void round_to() {
    for (auto* v : {&cloud, &queries, &A, &B, &U, &V, &u, &c}) *v = values_of(stored<T>(*v));
  }
};

struct Outputs {
  std::vector<double> update, lse, entropy;
};

/// The inverse frequencies of `rotary` written out: base^(-2t/rot) (explicit ones as given).
std::vector<double> default_frequencies(const Rotary& rotary) {
  std::vector<double> f;
  for (std::int64_t t = 0; t < rotary.dim / 2; ++t) {
    f.push_back(rotary.inverse_frequencies != nullptr
                    ? rotary.inverse_frequencies[t]
                    : std::pow(rotary.base,
                               -2.0 * static_cast<double>(t) / static_cast<double>(rotary.dim)));
  }
  return f;
}

/// R(Delta), r x r, built entry by entry: the identity, with the block (a, b) -> (cos, -sin;
/// sin, cos) of angle Delta w_t on each rotated pair t.
std::vector<double> rotation(const Rotary& rotary, const std::vector<double>& frequencies,
                             std::int64_t delta, std::int64_t r) {
  const auto n = [](std::int64_t x) { return static_cast<std::size_t>(x); };
  const std::int64_t rot = rotary.dim;
  std::vector<double> R(n(r * r), 0.0);
  for (std::int64_t k = 0; k < r; ++k) R[n(k * r + k)] = 1.0;
  for (std::int64_t t = 0; t < rot / 2; ++t) {
    const std::int64_t a = rotary.pairing == RotaryPairing::interleaved ? 2 * t : t;
    const std::int64_t e = rotary.pairing == RotaryPairing::interleaved ? 2 * t + 1 : t + rot / 2;
    const double angle = static_cast<double>(delta) * frequencies[n(t)];
    R[n(a * r + a)] = std::cos(angle);
    R[n(a * r + e)] = -std::sin(angle);
    R[n(e * r + a)] = std::sin(angle);
    R[n(e * r + e)] = std::cos(angle);
  }
  return R;
}

/// The naive computation: for every pair, M = A_h^T R(p_j - p_i) B_g with R(Delta) the r x r
/// block rotation built entry by entry, s_ij = beta (q_i^T M x_j + u_h^T x_j), the softmax over
/// the visible keys, and delta_i = sum_h sum_j p_ij U_h V_g x_j + c. Double, as MATH.md writes it.
Outputs naive(const RotaryProblem& p, const std::vector<double>& frequencies) {
  const std::int64_t B = p.batch, N = p.tokens, Nq = p.Nq(), d = p.dim, H = p.heads, r = p.rank;
  const std::int64_t group = H / p.kv_heads;
  const auto n = [](std::int64_t x) { return static_cast<std::size_t>(x); };
  Outputs o;
  o.update.assign(n(B * Nq * d), 0.0);
  o.lse.assign(n(B * H * Nq), -std::numeric_limits<double>::infinity());
  o.entropy.assign(n(B * H * Nq), 0.0);
  for (std::int64_t b = 0; b < B; ++b) {
    const std::int64_t Lk = p.lengths ? p.key_lengths[n(b)] : N;
    const std::int64_t Lq = p.cross ? (p.lengths ? p.query_lengths[n(b)] : Nq) : Lk;
    const std::int64_t origin =
        p.query_position != kAlignToEnd ? p.query_position : p.key_position + Lk - Lq;
    const double* X = p.cloud.data() + b * N * d;
    const double* Q = (p.cross ? p.queries.data() + b * Nq * d : X);
    for (std::int64_t i = 0; i < Nq; ++i) {
      bool any = false;
      std::vector<double> delta(n(d), 0.0);
      for (std::int64_t h = 0; h < H; ++h) {
        const std::int64_t g = h / group;
        const std::int64_t pi =
            p.rotary.query_positions ? p.rotary.query_positions[b * Nq + i] : origin + i;
        std::vector<double> s(n(N), -std::numeric_limits<double>::infinity());
        bool visible_any = false;
        for (std::int64_t j = 0; j < N; ++j) {
          const bool visible = i < Lq && j < Lk && p.mask.allows(origin + i, p.key_position + j);
          if (!visible) continue;
          visible_any = true;
          const std::int64_t pj =
              p.rotary.key_positions ? p.rotary.key_positions[b * N + j] : p.key_position + j;
          const std::vector<double> R = rotation(p.rotary, frequencies, pj - pi, r);
          // M = A_h^T R B_g (d x d), then q_i^T M x_j.
          double score = 0.0;
          for (std::int64_t x = 0; x < d; ++x) {
            for (std::int64_t y = 0; y < d; ++y) {
              double m = 0.0;
              for (std::int64_t k = 0; k < r; ++k) {
                for (std::int64_t l = 0; l < r; ++l) {
                  m += p.A[n((h * r + k) * d + x)] * R[n(k * r + l)] * p.B[n((g * r + l) * d + y)];
                }
              }
              score += Q[i * d + x] * m * X[j * d + y];
            }
          }
          double ub = 0.0;
          for (std::int64_t x = 0; p.bias && x < d; ++x) ub += p.u[n(h * d + x)] * X[j * d + x];
          s[n(j)] = p.beta * (score + ub);
        }
        if (!visible_any) continue;
        any = true;
        const double m = *std::max_element(s.begin(), s.end());
        double Z = 0.0;
        for (double v : s) Z += std::exp(v - m);
        const double lse = m + std::log(Z);
        double expected = 0.0;
        for (std::int64_t j = 0; j < N; ++j) {
          const double w = std::exp(s[n(j)] - lse);
          if (w == 0.0) continue;
          expected += w * s[n(j)];
          // F_h x_j = U_h V_g x_j.
          for (std::int64_t x = 0; x < d; ++x) {
            double f = 0.0;
            for (std::int64_t k = 0; k < r; ++k) {
              double v = 0.0;
              for (std::int64_t y = 0; y < d; ++y) v += p.V[n((g * r + k) * d + y)] * X[j * d + y];
              f += p.U[n((h * d + x) * r + k)] * v;
            }
            delta[n(x)] += w * f;
          }
        }
        o.lse[n((b * H + h) * Nq + i)] = lse;
        o.entropy[n((b * H + h) * Nq + i)] = lse - expected;
      }
      for (std::int64_t x = 0; any && x < d; ++x) {
        o.update[n((b * Nq + i) * d + x)] = delta[n(x)] + (p.offset ? p.c[n(x)] : 0.0);
      }
    }
  }
  return o;
}

/// attend_factored of `p` in storage T on `device`, the outputs read back in double.
template <class T>
Outputs run(const RotaryProblem& p, Device device, const Rotary& rotary, std::int64_t kv_heads,
            const std::vector<double>* B_override = nullptr,
            const std::vector<double>* V_override = nullptr) {
  const std::vector<T> cloud = stored<T>(p.cloud), queries = stored<T>(p.queries);
  const std::vector<T> A = stored<T>(p.A), B = stored<T>(B_override ? *B_override : p.B);
  const std::vector<T> U = stored<T>(p.U), V = stored<T>(V_override ? *V_override : p.V);
  const std::vector<T> u = stored<T>(p.u), c = stored<T>(p.c);
  const auto n = [](std::int64_t x) { return static_cast<std::size_t>(x); };
  std::vector<T> update(n(p.batch * p.Nq() * p.dim));
  std::vector<Stat<T>> lse(n(p.batch * p.heads * p.Nq())), entropy(lse.size());
  AttentionInput<T> in;
  in.cloud = cloud.data();
  in.batch = p.batch;
  in.tokens = p.tokens;
  in.dim = p.dim;
  in.layer = {};
  in.beta = p.beta;
  in.mask = p.mask;
  in.key_lengths = p.lengths ? p.key_lengths.data() : nullptr;
  if (p.cross) {
    in.queries = queries.data();
    in.query_tokens = p.query_tokens;
    in.query_lengths = p.lengths ? p.query_lengths.data() : nullptr;
  }
  in.key_position = p.key_position;
  in.query_position = p.query_position;
  FactoredLayer<T> layer;
  layer.heads = p.heads;
  layer.rank = p.rank;
  layer.query_factor = A.data();
  layer.key_factor = B.data();
  layer.content_up = U.data();
  layer.content_down = V.data();
  layer.key_bias = p.bias ? u.data() : nullptr;
  layer.offset = p.offset ? c.data() : nullptr;
  layer.kv_heads = kv_heads;
  layer.rotary = rotary;
  attend_factored(in, layer, AttentionOutput<T>{update.data(), lse.data(), entropy.data()},
                  {device, 2});
  Outputs o;
  o.update = values_of(update);
  o.lse.assign(lse.begin(), lse.end());
  o.entropy.assign(entropy.begin(), entropy.end());
  return o;
}

void expect_close(const Outputs& got, const Outputs& want, double tolerance,
                  const std::string& what) {
  EXPECT_LT(testing::relative_error(got.update, want.update), tolerance) << what << ": update";
  EXPECT_LT(testing::relative_error(got.lse, want.lse), tolerance) << what << ": lse";
  EXPECT_LT(testing::relative_error(got.entropy, want.entropy), tolerance) << what << ": entropy";
}

struct Case {
  const char* name;
  std::int64_t heads, kv_heads, rank, rot;
  RotaryPairing pairing;
  Mask mask;
  bool cross, lengths, bias;
  std::int64_t key_position;
};

class RotaryMatchesNaive : public ::testing::TestWithParam<Case> {};

TEST_P(RotaryMatchesNaive, OnCpuAndReferenceInDoubleAndFloat) {
  const Case k = GetParam();
  RotaryProblem p;
  p.heads = k.heads;
  p.kv_heads = k.kv_heads;
  p.rank = k.rank;
  p.mask = k.mask;
  p.cross = k.cross;
  p.query_tokens = k.cross ? 5 : 0;
  p.lengths = k.lengths;
  p.bias = k.bias;
  p.key_position = k.key_position;
  p.rotary.dim = k.rot;
  p.rotary.base = 7.0;  // low, so that every frequency turns the pairs visibly over 9 positions
  p.rotary.pairing = k.pairing;
  p.fill(300 + static_cast<std::uint64_t>(k.rot + 7 * k.kv_heads));
  const std::vector<double> f = default_frequencies(p.rotary);
  const Outputs exact = naive(p, f);
  // The layer really moves with the positions: the position-free update differs.
  RotaryProblem plain = p;
  plain.rotary.dim = 0;
  if (k.rot != 0) {
    EXPECT_GT(testing::relative_error(naive(plain, {}).update, exact.update), 1e-3) << k.name;
  }

  expect_close(run<double>(p, Device::cpu, p.rotary, k.kv_heads), exact, 1e-12,
               std::string(k.name) + " cpu f64");
  expect_close(run<double>(p, Device::reference, p.rotary, k.kv_heads), exact, 1e-12,
               std::string(k.name) + " reference f64");
  RotaryProblem rounded = p;
  rounded.round_to<float>();
  const Outputs exact_float = naive(rounded, f);
  expect_close(run<float>(p, Device::cpu, p.rotary, k.kv_heads), exact_float, 1e-5,
               std::string(k.name) + " cpu f32");
  // The reference computes float input in double and rounds its outputs to float once.
  expect_close(run<float>(p, Device::reference, p.rotary, k.kv_heads), exact_float, 1e-7,
               std::string(k.name) + " reference f32");
}

const RotaryPairing kHalf = RotaryPairing::half_split;
const RotaryPairing kPairs = RotaryPairing::interleaved;

INSTANTIATE_TEST_SUITE_P(
    Cases, RotaryMatchesNaive,
    ::testing::Values(
        Case{"half_split_full", 4, 4, 4, 4, kHalf, Mask::none(), false, false, true, 0},
        Case{"interleaved_full", 4, 4, 4, 4, kPairs, Mask::none(), false, false, true, 0},
        Case{"half_split_partial", 2, 2, 6, 4, kHalf, Mask::causal(), false, false, true, 0},
        Case{"interleaved_partial", 2, 2, 6, 2, kPairs, Mask::causal(), false, true, false, 3},
        Case{"grouped_causal", 4, 2, 4, 4, kHalf, Mask::causal(), false, true, true, 0},
        Case{"multi_query_window", 4, 1, 4, 4, kPairs, Mask::sliding_window(3), false, false, true,
             5},
        Case{"cross_lengths", 4, 2, 4, 4, kHalf, Mask::causal(), true, true, true, 2},
        Case{"cross_window", 2, 1, 6, 6, kPairs, Mask::sliding_window(2), true, false, false, 0},
        Case{"grouped_no_rotary", 4, 2, 4, 0, kHalf, Mask::causal(), false, true, true, 0}),
    [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

TEST(Rotary, ShiftingEveryPositionLeavesTheUpdate) {
  for (const bool interleaved : {false, true}) {
    RotaryProblem p;
    p.rotary.dim = 4;
    p.rotary.pairing = interleaved ? kPairs : kHalf;
    p.rotary.base = 50.0;
    p.mask = Mask::causal();
    p.fill(41);
    const Outputs at0_f64 = run<double>(p, Device::cpu, p.rotary, p.kv_heads);
    const Outputs at0_f32 = run<float>(p, Device::cpu, p.rotary, p.kv_heads);
    RotaryProblem shifted = p;
    shifted.key_position = 1000;  // queries aligned to the end: shifted by the same 1000
    expect_close(run<double>(shifted, Device::cpu, p.rotary, p.kv_heads), at0_f64, 1e-12,
                 "shift f64");
    expect_close(run<float>(shifted, Device::cpu, p.rotary, p.kv_heads), at0_f32, 1e-5,
                 "shift f32");
    // Explicit rotary positions, all shifted by 777 from the mask positions.
    std::vector<std::int64_t> keys, queries;
    for (std::int64_t b = 0; b < p.batch; ++b) {
      for (std::int64_t j = 0; j < p.tokens; ++j) keys.push_back(777 + j);
    }
    queries = keys;
    Rotary explicit_positions = p.rotary;
    explicit_positions.key_positions = keys.data();
    explicit_positions.query_positions = queries.data();
    expect_close(run<double>(p, Device::cpu, explicit_positions, p.kv_heads), at0_f64, 1e-12,
                 "explicit positions f64");
    expect_close(run<float>(p, Device::cpu, explicit_positions, p.kv_heads), at0_f32, 1e-5,
                 "explicit positions f32");
    // Moving one key's rotary position changes the update (the positions are read).
    keys[3] += 2;
    EXPECT_GT(
        testing::relative_error(run<double>(p, Device::cpu, explicit_positions, p.kv_heads).update,
                                at0_f64.update),
        1e-6);
  }
}

TEST(Rotary, ZeroFrequenciesAndNoRotationAreThePositionFreeLayer) {
  RotaryProblem p;
  p.rank = 6;
  p.mask = Mask::sliding_window(4);
  p.fill(52);
  const Rotary none;
  const std::vector<double> zeros(3, 0.0);
  Rotary zero;
  zero.dim = 6;
  zero.inverse_frequencies = zeros.data();
  const Outputs f64 = run<double>(p, Device::reference, none, 0);
  const Outputs f32 = run<float>(p, Device::cpu, none, 0);
  // cos 0 = 1 and sin 0 = 0 rotate exactly: the same values bit for bit.
  EXPECT_EQ(run<float>(p, Device::cpu, zero, 0).update, f32.update);
  EXPECT_EQ(run<float>(p, Device::cpu, zero, 0).lse, f32.lse);
  expect_close(run<double>(p, Device::cpu, zero, 0), f64, 1e-12, "zero frequencies, cpu f64");
  expect_close(run<double>(p, Device::reference, zero, 0), f64, 1e-12, "zero frequencies, ref");
}

TEST(Rotary, GroupedHeadsAreTheLayerWithBAndVRepeated) {
  for (const std::int64_t kv : {std::int64_t{4}, std::int64_t{2}, std::int64_t{1}}) {
    for (const bool bias : {false, true}) {
      RotaryProblem p;
      p.heads = 4;
      p.kv_heads = kv;
      p.bias = bias;
      p.mask = Mask::causal();
      p.rotary.dim = 4;
      p.fill(60 + static_cast<std::uint64_t>(kv));
      // B and V repeated heads / kv times, as transformers' repeat_kv lays them out.
      std::vector<double> B, V;
      const std::int64_t block = p.rank * p.dim;
      for (std::int64_t h = 0; h < p.heads; ++h) {
        const auto first = static_cast<std::ptrdiff_t>((h / (p.heads / kv)) * block);
        B.insert(B.end(), p.B.begin() + first, p.B.begin() + first + block);
        V.insert(V.end(), p.V.begin() + first, p.V.begin() + first + block);
      }
      for (const Rotary& rotary : {Rotary{}, p.rotary}) {
        const std::string what = "kv " + std::to_string(kv) + " bias " + std::to_string(bias) +
                                 " rot " + std::to_string(rotary.dim);
        expect_close(run<float>(p, Device::cpu, rotary, kv),
                     run<float>(p, Device::cpu, rotary, 0, &B, &V), 1e-6, what + " cpu f32");
        expect_close(run<double>(p, Device::cpu, rotary, kv),
                     run<double>(p, Device::cpu, rotary, 0, &B, &V), 1e-13, what + " cpu f64");
        expect_close(run<double>(p, Device::reference, rotary, kv),
                     run<double>(p, Device::reference, rotary, 0, &B, &V), 1e-13,
                     what + " reference");
      }
      if (kv == 4) {  // kv_heads == heads is the layer of today, bit for bit
        EXPECT_EQ(run<float>(p, Device::cpu, Rotary{}, 4).update,
                  run<float>(p, Device::cpu, Rotary{}, 0).update);
      }
    }
  }
}

template <class T>
void expect_16bit_within_rounding(double update_ulp) {
  RotaryProblem p;
  p.heads = 4;
  p.kv_heads = 2;
  p.mask = Mask::causal();
  p.rotary.dim = 4;
  p.rotary.pairing = kPairs;
  p.fill(70);
  RotaryProblem rounded = p;
  rounded.round_to<T>();
  const Outputs exact = naive(rounded, default_frequencies(p.rotary));
  const Outputs got = run<T>(p, Device::cpu, p.rotary, p.kv_heads);
  // The update is float32 work rounded once to T: within one rounding of T (half an ulp, with
  // room for the float32 error) of the exact result of the stored inputs; lse and entropy are
  // float32 (docs/MATH.md §7).
  for (std::size_t i = 0; i < exact.update.size(); ++i) {
    EXPECT_LE(std::abs(got.update[i] - exact.update[i]),
              update_ulp * std::abs(exact.update[i]) + 1e-6)
        << i;
  }
  EXPECT_LT(testing::relative_error(got.lse, exact.lse), 1e-5);
  EXPECT_LT(testing::relative_error(got.entropy, exact.entropy), 1e-4);
}

TEST(Rotary, SixteenBitStorageIsWithinOneRoundingOfTheStoredInputs) {
  expect_16bit_within_rounding<bfloat16>(std::ldexp(1.0, -8));
  expect_16bit_within_rounding<float16>(std::ldexp(1.0, -11));
}

TEST(RotaryFrequencies, EachScalingAsTransformersWritesIt) {
  Rotary r;
  r.dim = 8;
  r.base = 10000.0;
  std::vector<double> base_f;
  for (int t = 0; t < 4; ++t) base_f.push_back(1.0 / std::pow(10000.0, 2.0 * t / 8.0));
  const auto expect_equal = [](const std::vector<double>& got, const std::vector<double>& want,
                               const char* what) {
    ASSERT_EQ(got.size(), want.size()) << what;
    for (std::size_t t = 0; t < want.size(); ++t) {
      EXPECT_NEAR(got[t], want[t], 1e-15 * std::abs(want[t]) + 1e-300) << what << " t=" << t;
    }
  };
  expect_equal(rotary_inverse_frequencies(r, 100), base_f, "default");

  r.scaling = RotaryScaling::linear;
  r.factor = 4.0;
  std::vector<double> linear;
  for (double f : base_f) linear.push_back(f / 4.0);
  expect_equal(rotary_inverse_frequencies(r, 100), linear, "linear");

  r.scaling = RotaryScaling::dynamic_ntk;
  r.factor = 2.0;
  r.original_max_positions = 64;
  // Within the original context the base is unchanged; beyond it
  // base' = base (factor L / L0 - (factor - 1))^(rot / (rot - 2)).
  expect_equal(rotary_inverse_frequencies(r, 64), base_f, "dynamic within");
  expect_equal(rotary_inverse_frequencies(r, 10), base_f, "dynamic short");
  const double grown = 10000.0 * std::pow(2.0 * 256.0 / 64.0 - 1.0, 8.0 / 6.0);
  std::vector<double> dynamic;
  for (int t = 0; t < 4; ++t) dynamic.push_back(1.0 / std::pow(grown, 2.0 * t / 8.0));
  expect_equal(rotary_inverse_frequencies(r, 256), dynamic, "dynamic beyond");

  // llama3 with rot 32 so that every band holds a frequency.
  Rotary l;
  l.dim = 32;
  l.base = 500000.0;
  l.scaling = RotaryScaling::llama3;
  l.factor = 8.0;
  l.low_freq_factor = 1.0;
  l.high_freq_factor = 4.0;
  l.original_max_positions = 8192;
  const std::vector<double> got = rotary_inverse_frequencies(l, 1);
  int low = 0, high = 0, medium = 0;
  for (int t = 0; t < 16; ++t) {
    const double f = 1.0 / std::pow(500000.0, 2.0 * t / 32.0);
    const double wavelen = 2.0 * kPi / f;
    double want = f;
    if (wavelen < 8192.0 / 4.0) {
      ++high;
    } else if (wavelen > 8192.0 / 1.0) {
      want = f / 8.0;
      ++low;
    } else {
      const double smooth = (8192.0 / wavelen - 1.0) / (4.0 - 1.0);
      want = (1.0 - smooth) * f / 8.0 + smooth * f;
      ++medium;
    }
    EXPECT_NEAR(got[static_cast<std::size_t>(t)], want, 1e-15 * want) << "llama3 t=" << t;
  }
  EXPECT_GT(low, 0);
  EXPECT_GT(high, 0);
  EXPECT_GT(medium, 0);

  // Explicit frequencies are returned as given.
  const std::vector<double> given = {1.0, 0.5f, 0.25, 0.125};
  Rotary e;
  e.dim = 8;
  e.inverse_frequencies = given.data();
  expect_equal(rotary_inverse_frequencies(e, 1), given, "explicit");
}

TEST(RotaryFrequencies, DynamicScalingGrowsWithTheCallsLongestSequence) {
  // A call of 9 keys at positions 0..8 with original context 4: the frequencies of length 9.
  RotaryProblem p;
  p.batch = 1;
  p.rotary.dim = 4;
  p.rotary.scaling = RotaryScaling::dynamic_ntk;
  p.rotary.factor = 2.0;
  p.rotary.original_max_positions = 4;
  p.mask = Mask::causal();
  p.fill(80);
  const std::vector<double> f = rotary_inverse_frequencies(p.rotary, 9);
  EXPECT_NE(f, rotary_inverse_frequencies(p.rotary, 4));
  Rotary explicit_f;
  explicit_f.dim = 4;
  explicit_f.inverse_frequencies = f.data();
  const Outputs want = naive(p, f);
  expect_close(run<double>(p, Device::cpu, p.rotary, p.kv_heads), want, 1e-12, "dynamic f64");
  expect_close(run<double>(p, Device::cpu, explicit_f, p.kv_heads), want, 1e-12, "explicit f64");
  RotaryProblem rounded = p;
  rounded.round_to<float>();
  expect_close(run<float>(p, Device::cpu, p.rotary, p.kv_heads), naive(rounded, f), 1e-5,
               "dynamic f32");
}

TEST(RotaryFrequencies, ConfigNamesParseAndOthersAreRefusedByName) {
  EXPECT_EQ(rotary_scaling_from_string("default"), RotaryScaling::none);
  EXPECT_EQ(rotary_scaling_from_string("linear"), RotaryScaling::linear);
  EXPECT_EQ(rotary_scaling_from_string("dynamic"), RotaryScaling::dynamic_ntk);
  EXPECT_EQ(rotary_scaling_from_string("llama3"), RotaryScaling::llama3);
  for (const RotaryScaling s : {RotaryScaling::none, RotaryScaling::linear,
                                RotaryScaling::dynamic_ntk, RotaryScaling::llama3}) {
    EXPECT_EQ(rotary_scaling_from_string(to_string(s)), s);
  }
  try {
    rotary_scaling_from_string("yarn");
    FAIL() << "yarn accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::unsupported);
    EXPECT_NE(std::string(e.what()).find("'yarn'"), std::string::npos) << e.what();
  }
  EXPECT_EQ(rotary_pairing_from_string("interleaved"), RotaryPairing::interleaved);
  EXPECT_THROW(rotary_pairing_from_string("neox"), Error);
}

/// The problem of a factored call on a machine whose GPU is usable.
Machine with_gpu() {
  Machine m;
  m.cuda_built = m.cuda_device = true;
  return m;
}

TEST(RotaryRoutes, HostPathsComputeAndTheGpuTakesTheUpdateUnexpanded) {
  RotaryProblem p;
  p.rotary.dim = 4;
  p.heads = 4;
  p.kv_heads = 2;
  p.fill(90);
  const std::vector<float> x(p.cloud.begin(), p.cloud.end()), A(p.A.begin(), p.A.end());
  const std::vector<float> B(p.B.begin(), p.B.end()), U(p.U.begin(), p.U.end());
  const std::vector<float> V(p.V.begin(), p.V.end());
  std::vector<float> update(x.size());
  AttentionInput<float> in;
  in.cloud = x.data();
  in.batch = p.batch;
  in.tokens = p.tokens;
  in.dim = p.dim;
  FactoredLayer<float> layer{p.heads, p.rank, A.data(), B.data(), U.data(), V.data()};
  layer.kv_heads = 2;
  layer.rotary.dim = 4;
  const AttentionOutput<float> out{update.data()};

  emflow::Problem problem = describe(in, layer, out);
  EXPECT_EQ(problem.rotary_dim, 4);
  EXPECT_EQ(problem.kv_heads, 2);
  // The GPU computes the float32 update unexpanded (its projections, then the SDPA operator's
  // float32 kernel; tests/cuda/tc_factored_test.cpp holds its values), and Device::automatic
  // takes it there; without a GPU, the engine.
  const Route gpu = route(problem, Device::cuda, with_gpu());
  EXPECT_TRUE(gpu.supported) << gpu.reason;
  EXPECT_EQ(gpu.kernel, Kernel::cuda_fused);
  EXPECT_FALSE(gpu.expanded);
  EXPECT_EQ(route(problem, Device::automatic, with_gpu()).device, Device::cuda);
  Machine host_only = with_gpu();
  host_only.cuda_device = false;
  const Route automatic = route(problem, Device::automatic, host_only);
  EXPECT_EQ(automatic.device, Device::cpu);
  EXPECT_EQ(automatic.kernel, Kernel::cpu_fused);
  EXPECT_FALSE(automatic.expanded);
  // Double and the reference: the factored form in double, never expanded with a rotation; the
  // GPU's double path would expand it, and refuses by name.
  problem.storage = Dtype::float64;
  const Route gpu64 = route(problem, Device::cuda, with_gpu());
  EXPECT_FALSE(gpu64.supported);
  EXPECT_NE(gpu64.reason.find("rotary positions (rotary.dim 4)"), std::string::npos)
      << gpu64.reason;
  EXPECT_NE(gpu64.reason.find("grouped kv heads (kv_heads 2 of 4)"), std::string::npos)
      << gpu64.reason;
  for (const Device device : {Device::cpu, Device::reference}) {
    const Route r = route(problem, device, with_gpu());
    EXPECT_TRUE(r.supported) << r.reason;
    EXPECT_EQ(r.kernel, Kernel::reference);
    EXPECT_FALSE(r.expanded);
  }
  problem.rotary_dim = 0;  // grouped only: the expansion repeats B and V
  EXPECT_TRUE(route(problem, Device::reference, with_gpu()).expanded);
  problem.rotary_dim = 4;
  // Non-finite float input: the double factored reference.
  problem.storage = Dtype::float32;
  problem.finite = false;
  EXPECT_FALSE(route(problem, Device::cpu, with_gpu()).expanded);
  // The decode cache and the partial state compute them on the host, in the factored form in
  // double; the GPU refuses them by name.
  for (const Operation operation : {Operation::decode, Operation::partial}) {
    problem.operation = operation;
    const Route host = route(problem, Device::cpu, with_gpu(), "DecodeCache");
    EXPECT_TRUE(host.supported) << host.reason;
    EXPECT_EQ(host.kernel, Kernel::reference);
    EXPECT_EQ(host.computes, Dtype::float64);
    EXPECT_FALSE(host.expanded);
    EXPECT_EQ(route(problem, Device::automatic, with_gpu()).device, Device::cpu);
    const Route device = route(problem, Device::cuda, with_gpu(), "DecodeCache");
    EXPECT_FALSE(device.supported);
    EXPECT_NE(device.reason.find("rotary positions (rotary.dim 4)"), std::string::npos)
        << device.reason;
  }
  problem.operation = Operation::update;

  // The entry point on the GPU: where none is usable, refused as a missing device (with a GPU it
  // computes, above).
  if (!this_machine().cuda_device) {
    try {
      attend_factored(in, layer, out, {Device::cuda});
      FAIL() << "cuda accepted a rotary layer without a device";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::unsupported);
      EXPECT_NE(std::string(e.what()).find("device 'cuda' requested but unavailable"),
                std::string::npos)
          << e.what();
    }
  }
  {
    // The decode cache of the rotary, grouped layer: the first cloud token by token equals the
    // one-pass causal update of that cloud.
    DecodeCache cache(layer, p.dim, 1.0);
    AttentionInput<float> one = in;
    one.batch = 1;
    one.mask = Mask::causal();
    std::vector<float> want(static_cast<std::size_t>(p.tokens * p.dim)), got(want.size());
    attend_factored(one, layer, AttentionOutput<float>{want.data()}, {Device::cpu});
    for (std::int64_t t = 0; t < p.tokens; ++t) {
      cache.append(x.data() + t * p.dim, 1);
      cache.attend(x.data() + t * p.dim, 1, Mask::causal(),
                   AttentionOutput<float>{got.data() + t * p.dim});
    }
    EXPECT_LT(testing::relative_error(got, want), 1e-6);
    EXPECT_GT(testing::relative_error(got, std::vector<float>(got.size(), 0.0f)), 0.1);
  }
  std::vector<float> d_update(x.size(), 1.0f), d_x(x.size());
  UpstreamGradients<float> upstream;
  upstream.update = d_update.data();
  FactoredGradientOutput<float> gradients;
  gradients.cloud = d_x.data();
  try {
    attend_factored_backward(in, layer, upstream, gradients);
    FAIL() << "the backward pass accepted a rotary layer";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::unsupported);
    EXPECT_NE(std::string(e.what()).find("no backward pass"), std::string::npos) << e.what();
  }
  // And the layer runs where the table says.
  EXPECT_NO_THROW(attend_factored(in, layer, out, {Device::cpu}));
}

// emflow::rotary_drift (the report of `emflow convert --report` for rotary models) against the
// forms M(t) = A^T R(-t) B built entry by entry, for both pairings and a partial rotary dim.
TEST(RotaryDrift, EqualsTheDenseFormsBuiltEntryByEntry) {
  const std::int64_t r = 4, w = 6;
  const std::vector<double> A = testing::random_tensor({r, w}, 41).values(),
                            B = testing::random_tensor({r, w}, 42).values();
  const std::vector<std::int64_t> offsets = {0, 1, 3, 64, 1000};
  for (RotaryPairing pairing : {RotaryPairing::half_split, RotaryPairing::interleaved}) {
    for (std::int64_t dim : {2, 4}) {
      Rotary rotary;
      rotary.dim = dim;
      rotary.base = 50.0;
      rotary.pairing = pairing;
      SCOPED_TRACE(std::string(to_string(pairing)) + " dim " + std::to_string(dim));
      const RotaryDrift drift = rotary_drift(A.data(), B.data(), r, w, rotary, offsets);
      ASSERT_EQ(drift.offsets, offsets);
      const auto form = [&](std::int64_t t) {  // M(t) = A^T R(-t) B, w x w
        const std::vector<double> R = rotation(rotary, default_frequencies(rotary), -t, r);
        std::vector<double> M(static_cast<std::size_t>(w * w), 0.0);
        for (std::int64_t x = 0; x < w; ++x) {
          for (std::int64_t y = 0; y < w; ++y) {
            for (std::int64_t k = 0; k < r; ++k) {
              for (std::int64_t l = 0; l < r; ++l) {
                M[static_cast<std::size_t>(x * w + y)] += A[static_cast<std::size_t>(k * w + x)] *
                                                          R[static_cast<std::size_t>(k * r + l)] *
                                                          B[static_cast<std::size_t>(l * w + y)];
              }
            }
          }
        }
        return M;
      };
      const std::vector<double> M0 = form(0);
      double norm0 = 0.0;
      for (double v : M0) norm0 += v * v;
      norm0 = std::sqrt(norm0);
      for (std::size_t k = 0; k < offsets.size(); ++k) {
        const std::vector<double> M = form(offsets[k]);
        double inner = 0.0, norm = 0.0, change = 0.0;
        for (std::size_t e = 0; e < M.size(); ++e) {
          inner += M[e] * M0[e];
          norm += M[e] * M[e];
          change += (M[e] - M0[e]) * (M[e] - M0[e]);
        }
        EXPECT_NEAR(drift.cosine[k], inner / (std::sqrt(norm) * norm0), 1e-12) << offsets[k];
        EXPECT_NEAR(drift.relative_change[k], std::sqrt(change) / norm0, 1e-12) << offsets[k];
      }
      // The form turns: some offset moves it by a fair part of its size.
      EXPECT_GT(*std::max_element(drift.relative_change.begin(), drift.relative_change.end()), 0.1);
    }
  }
}

TEST(RotaryDrift, OnePlaneRotationAndNoRotation) {
  // A = B = I of one rotated pair at frequency base^0 = 1: M(t) = R(-t), whose cosine with I is
  // cos t and whose distance from it 2 |sin(t / 2)| times |I|.
  const std::vector<double> identity = {1.0, 0.0, 0.0, 1.0};
  Rotary rotary;
  rotary.dim = 2;
  const RotaryDrift drift = rotary_drift(identity.data(), identity.data(), 2, 2, rotary, {1, 2, 7});
  for (std::size_t k = 0; k < 3; ++k) {
    const double t = static_cast<double>(drift.offsets[k]);
    EXPECT_NEAR(drift.cosine[k], std::cos(t), 1e-14);
    EXPECT_NEAR(drift.relative_change[k], 2.0 * std::abs(std::sin(t / 2.0)), 1e-14);
  }
  // Without rotation the form is the same at every offset.
  const RotaryDrift still = rotary_drift(identity.data(), identity.data(), 2, 2, Rotary{}, {5});
  EXPECT_DOUBLE_EQ(still.cosine[0], 1.0);
  EXPECT_DOUBLE_EQ(still.relative_change[0], 0.0);
}

TEST(RotaryDrift, BadArgumentsAreNamed) {
  const std::vector<double> f(8, 1.0);
  Rotary rotary;
  rotary.dim = 2;
  const auto message = [](auto&& call) {
    try {
      call();
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message([&] {
              rotary_drift(nullptr, f.data(), 2, 4, rotary, {1});
            }).find("'query_factor' must not be null"),
            std::string::npos);
  EXPECT_NE(message([&] {
              rotary_drift(f.data(), f.data(), 0, 4, rotary, {1});
            }).find("'rank' must be >= 1, got 0"),
            std::string::npos);
  EXPECT_NE(message([&] {
              rotary_drift(f.data(), f.data(), 2, 4, rotary, {1, -3});
            }).find("'offsets' must be >= 0, got -3 at entry 1"),
            std::string::npos);
  rotary.dim = 3;
  EXPECT_NE(message([&] {
              rotary_drift(f.data(), f.data(), 2, 4, rotary, {1});
            }).find("'rotary.dim' must be 0 (none) or even"),
            std::string::npos);
}

TEST(RotaryArguments, EachBadFieldIsNamedWithItsValue) {
  RotaryProblem p;
  p.heads = 4;
  p.kv_heads = 4;
  p.fill(95);
  const std::vector<double> zeros(2, 0.0), nan_f = {1.0, std::nan("")};
  std::vector<std::int64_t> far(static_cast<std::size_t>(p.batch * p.tokens), 0);
  far[5] = (std::int64_t{1} << 60) + 1;
  struct Bad {
    const char* argument;
    const char* value;
    void (*edit)(FactoredLayer<double>&);
  };
  static const std::vector<double>* zeros_p = nullptr;
  static const std::vector<double>* nan_p = nullptr;
  static const std::vector<std::int64_t>* far_p = nullptr;
  zeros_p = &zeros;
  nan_p = &nan_f;
  far_p = &far;
  const Bad cases[] = {
      {"rotary.dim", "got 3", [](FactoredLayer<double>& l) { l.rotary.dim = 3; }},
      {"rotary.dim", "got 6", [](FactoredLayer<double>& l) { l.rotary.dim = 6; }},
      {"rotary.dim", "got -2", [](FactoredLayer<double>& l) { l.rotary.dim = -2; }},
      {"rotary.base", "got 1",
       [](FactoredLayer<double>& l) {
         l.rotary.dim = 4;
         l.rotary.base = 1.0;
       }},
      {"rotary.base", "got nan",
       [](FactoredLayer<double>& l) {
         l.rotary.dim = 4;
         l.rotary.base = std::nan("");
       }},
      {"kv_heads", "got 3", [](FactoredLayer<double>& l) { l.kv_heads = 3; }},
      {"kv_heads", "got 8", [](FactoredLayer<double>& l) { l.kv_heads = 8; }},
      {"kv_heads", "got -1", [](FactoredLayer<double>& l) { l.kv_heads = -1; }},
      {"rotary.factor", "got 0.5",
       [](FactoredLayer<double>& l) {
         l.rotary.dim = 4;
         l.rotary.scaling = RotaryScaling::linear;
         l.rotary.factor = 0.5;
       }},
      {"rotary.original_max_positions", "got 0",
       [](FactoredLayer<double>& l) {
         l.rotary.dim = 4;
         l.rotary.scaling = RotaryScaling::dynamic_ntk;
         l.rotary.factor = 2.0;
       }},
      {"rotary.dim", "dynamic scaling",
       [](FactoredLayer<double>& l) {
         l.rotary.dim = 2;
         l.rotary.scaling = RotaryScaling::dynamic_ntk;
         l.rotary.factor = 2.0;
         l.rotary.original_max_positions = 8;
       }},
      {"rotary.high_freq_factor", "got 1",
       [](FactoredLayer<double>& l) {
         l.rotary.dim = 4;
         l.rotary.scaling = RotaryScaling::llama3;
         l.rotary.factor = 8.0;
         l.rotary.original_max_positions = 8192;
         l.rotary.low_freq_factor = 1.0;
         l.rotary.high_freq_factor = 1.0;
       }},
      {"rotary.low_freq_factor", "got 0",
       [](FactoredLayer<double>& l) {
         l.rotary.dim = 4;
         l.rotary.scaling = RotaryScaling::llama3;
         l.rotary.factor = 8.0;
         l.rotary.original_max_positions = 8192;
         l.rotary.low_freq_factor = 0.0;
       }},
      {"rotary.scaling", "got linear",
       [](FactoredLayer<double>& l) {
         l.rotary.dim = 4;
         l.rotary.inverse_frequencies = zeros_p->data();
         l.rotary.scaling = RotaryScaling::linear;
         l.rotary.factor = 2.0;
       }},
      {"rotary.inverse_frequencies", "entry 1 must be finite",
       [](FactoredLayer<double>& l) {
         l.rotary.dim = 4;
         l.rotary.inverse_frequencies = nan_p->data();
       }},
      {"rotary.inverse_frequencies", "needs rotary.dim > 0",
       [](FactoredLayer<double>& l) { l.rotary.inverse_frequencies = zeros_p->data(); }},
      {"rotary.scaling", "needs rotary.dim > 0",
       [](FactoredLayer<double>& l) { l.rotary.scaling = RotaryScaling::llama3; }},
      {"rotary.key_positions", "entry 5 must be within +-2^60",
       [](FactoredLayer<double>& l) {
         l.rotary.dim = 4;
         l.rotary.key_positions = far_p->data();
       }},
      {"rotary.pairing", "got 7",
       [](FactoredLayer<double>& l) {
         l.rotary.dim = 4;
         l.rotary.pairing = static_cast<RotaryPairing>(7);
       }},
  };
  for (const Bad& bad : cases) {
    AttentionInput<double> in;
    in.cloud = p.cloud.data();
    in.batch = p.batch;
    in.tokens = p.tokens;
    in.dim = p.dim;
    FactoredLayer<double> layer{p.heads, p.rank, p.A.data(), p.B.data(), p.U.data(), p.V.data()};
    bad.edit(layer);
    std::vector<double> update(p.cloud.size());
    try {
      attend_factored(in, layer, AttentionOutput<double>{update.data()}, {Device::cpu});
      ADD_FAILURE() << bad.argument << " accepted";
    } catch (const Error& e) {
      const std::string message = e.what();
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << message;
      EXPECT_NE(message.find(std::string("argument '") + bad.argument + "'"), std::string::npos)
          << message;
      EXPECT_NE(message.find(bad.value), std::string::npos) << message;
    }
  }
}

}  // namespace
}  // namespace emflow
