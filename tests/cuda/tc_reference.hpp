// The host side of the tensor-core attention tests (tc_attention_test.cpp, tc_factored_test.cpp,
// tc_dense_test.cpp):
// 16-bit random inputs, and the attention of one problem in double or as a naive kernel in the
// same precision would compute it, for the accuracy rule of issue 16. A problem (`Case`) has
// the fields type, batch, heads, tokens, queries, dim, mask and key_lengths (empty: all keys;
// else also the query lengths); arrays are (heads, batch, rows, dim).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <type_traits>
#include <utility>
#include <vector>

#include "emflow/precision.hpp"
#include "emflow/types.hpp"
#include "kernels/tc_attention.hpp"

namespace emflow::testing {

using detail::TcType;

// ---- Shared by the tensor-core tests: storage types, poison, masks ----

// The value of stored bits.
template <class T>
T stored(std::uint16_t bits) {
  T t;
  t.bits = bits;
  return t;
}

// A NaN of the storage type, written to outputs before each call.
template <class T>
T poison() {
  if constexpr (std::is_same_v<T, float>) {
    return std::numeric_limits<float>::quiet_NaN();
  } else {
    return stored<T>(std::is_same_v<T, bfloat16> ? 0x7FC0 : 0x7E00);
  }
}

inline float as_float(float value) { return value; }
inline float as_float(bfloat16 value) { return to_float(value); }
inline float as_float(float16 value) { return to_float(value); }

// The precision each storage type runs in on the tensor cores: its own, or tf32 for float.
template <class T>
constexpr Precision tensor_core_precision() {
  return std::is_same_v<T, float> ? Precision::tf32 : storage_precision<T>();
}

// Calls f with a value of the storage type of `type` (bfloat16, float16, or float for TF32).
template <class F>
void with_storage_type(TcType type, F&& f) {
  if (type == TcType::bf16) {
    f(bfloat16{});
  } else if (type == TcType::f16) {
    f(float16{});
  } else {
    f(0.f);
  }
}

// Two runs of the same kernels (the blocking form against the stream-ordered one) hold the same
// bits: element by element, NaN patterns included; `what` names the array.
template <class T>
void expect_same_bits(const char* name, const char* what, const std::vector<T>& got,
                      const std::vector<T>& want) {
  ASSERT_EQ(got.size(), want.size()) << name << ": " << what;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0) {
      ADD_FAILURE() << name << ": " << what << " " << i << " differs";
      return;
    }
  }
}

inline const Mask kNone = Mask::none();
inline const Mask kCausal = Mask::causal();
inline const Mask kWindow5 = Mask::sliding_window(5);
inline const Mask kWindow37 = Mask::sliding_window(37);
inline constexpr TcType kBf16 = TcType::bf16;
inline constexpr TcType kF16 = TcType::f16;
inline constexpr TcType kTf32 = TcType::tf32;

struct Rounded {
  std::vector<std::uint16_t> bits;  // as stored (16-bit types; empty for float storage)
  std::vector<float> values;        // the same values in float
};

// `count` values uniform in [-range, range], rounded to `type`; for tf32 the floats as float
// storage holds them (TF32 rounds them only where the products read them).
inline Rounded random_rounded(TcType type, std::size_t count, std::mt19937& random,
                              float range = 1.f) {
  std::uniform_real_distribution<float> uniform(-range, range);
  Rounded r;
  for (std::size_t i = 0; i < count; ++i) {
    const float v = uniform(random);
    if (type == TcType::tf32) {
      r.values.push_back(v);
    } else if (type == TcType::bf16) {
      r.bits.push_back(to_bfloat16(v).bits);
      r.values.push_back(to_float(bfloat16{r.bits.back()}));
    } else {
      r.bits.push_back(to_float16(v).bits);
      r.values.push_back(to_float(float16{r.bits.back()}));
    }
  }
  return r;
}

// The stored values of `r` as T: its bits for the 16-bit types, its floats for float storage.
template <class T>
std::vector<T> as_type(const Rounded& r) {
  if constexpr (std::is_same_v<T, float>) {
    return r.values;
  } else {
    std::vector<T> out;
    for (std::uint16_t bits : r.bits) out.push_back(stored<T>(bits));
    return out;
  }
}

inline float round_to(TcType type, float v) {
  if (type == TcType::tf32) return round_to_tf32(v);
  return type == TcType::bf16 ? to_float(to_bfloat16(v)) : to_float(to_float16(v));
}

struct Result {
  std::vector<double> out, lse, entropy;  // entropy: 0 for a query that sees no key
};

// The visible keys of query i of cloud b, as the kernel's mask (self-attention with query
// lengths equal to the key lengths, or all queries against all keys, aligned to the end).
template <class Case>
KeyRange visible(const Case& c, int b, int i) {
  const std::int64_t keys = c.key_lengths.empty() ? c.tokens : c.key_lengths[b];
  const std::int64_t queries = c.key_lengths.empty() ? c.queries : c.key_lengths[b];
  if (i >= queries) return {0, 0};
  return c.mask.visible_keys_at(keys - queries + i, 0, keys);
}

// The base-2 scores of query i of head-cloud hb against its visible keys: in double, or as a
// naive float kernel computes them (float dot products, the bias and the scale in float).
template <class Case>
std::vector<double> scores(const Case& c, const std::vector<float>& q, const std::vector<float>& k,
                           const std::vector<float>& bias, float scale, bool naive, std::size_t hb,
                           int i, const KeyRange& keys) {
  const int d = c.dim, N = c.tokens, Nq = c.queries;
  std::vector<double> s;
  for (std::int64_t j = keys.first; j < keys.last; ++j) {
    const float* qi = &q[(hb * Nq + i) * d];
    const float* kj = &k[(hb * N + j) * d];
    const double beta = bias.empty() ? 0.0 : bias[hb * N + j];
    if (naive) {
      float dot = 0.f;
      for (int a = 0; a < d; ++a) dot += qi[a] * kj[a];
      s.push_back(scale * (dot + static_cast<float>(beta)));
    } else {
      double dot = 0.0;
      for (int a = 0; a < d; ++a) dot += static_cast<double>(qi[a]) * kj[a];
      s.push_back(static_cast<double>(scale) * (dot + beta));
    }
  }
  return s;
}

// naive = false: in double. naive = true: float scores, exponentials and sums; the normalised
// probabilities rounded to the storage type; float products with V; the entropy in float from
// the float weights.
template <class Case>
Result attention(const Case& c, const std::vector<float>& q, const std::vector<float>& k,
                 const std::vector<float>& v, const std::vector<float>& bias, float scale,
                 bool naive) {
  const int d = c.dim, N = c.tokens, Nq = c.queries;
  Result r;
  r.out.assign(static_cast<std::size_t>(c.heads) * c.batch * Nq * d, 0.0);
  r.lse.assign(static_cast<std::size_t>(c.heads) * c.batch * Nq,
               -std::numeric_limits<double>::infinity());
  r.entropy.assign(r.lse.size(), 0.0);
  for (int h = 0; h < c.heads; ++h) {
    for (int b = 0; b < c.batch; ++b) {
      const std::size_t hb = static_cast<std::size_t>(h) * c.batch + b;
      for (int i = 0; i < Nq; ++i) {
        const KeyRange keys = visible(c, b, i);
        if (keys.empty()) continue;
        const std::vector<double> s = scores(c, q, k, bias, scale, naive, hb, i, keys);
        const double m = *std::max_element(s.begin(), s.end());
        std::vector<double> w;
        double sum = 0.0;
        float sum_f = 0.f;
        for (double x : s) {
          if (naive) {
            w.push_back(std::exp2(static_cast<float>(x) - static_cast<float>(m)));
            sum_f += static_cast<float>(w.back());
          } else {
            w.push_back(std::exp2(x - m));
            sum += w.back();
          }
        }
        double* out = &r.out[(hb * Nq + i) * d];
        for (int a = 0; a < d; ++a) {
          double acc = 0.0;
          float acc_f = 0.f;
          for (std::size_t t = 0; t < w.size(); ++t) {
            const float value = v[(hb * N + keys.first + static_cast<std::int64_t>(t)) * d + a];
            if (naive) {
              acc_f += round_to(c.type, static_cast<float>(w[t]) / sum_f) * value;
            } else {
              acc += w[t] * value;
            }
          }
          out[a] = naive ? acc_f : acc / sum;
        }
        r.lse[hb * Nq + i] = naive ? (static_cast<float>(m) + std::log2(sum_f)) * 0.6931472f
                                   : (m + std::log2(sum)) * std::log(2.0);
        // The entropy -sum_j p_j ln p_j: naive, from the float weights in float; else from the
        // moment sum_j w_j (t_j - m) in base 2, in double.
        if (naive) {
          float h_f = 0.f;
          for (double x : w) {
            const float p = static_cast<float>(x) / sum_f;
            if (p > 0.f) h_f -= p * std::log(p);
          }
          r.entropy[hb * Nq + i] = h_f;
        } else {
          double moment = 0.0;
          for (std::size_t t = 0; t < w.size(); ++t) moment += w[t] * (s[t] - m);
          r.entropy[hb * Nq + i] = std::log(2.0) * (std::log2(sum) - moment / sum);
        }
      }
    }
  }
  return r;
}

// Largest |got - want|: an infinity both hold counts 0, a NaN on one side only counts +inf.
inline double max_difference(const std::vector<double>& got, const std::vector<double>& want) {
  double e = 0.0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (std::isinf(want[i]) && got[i] == want[i]) continue;
    e = std::max(e, std::abs(got[i] - want[i]));
    if (std::isnan(got[i]) != std::isnan(want[i])) e = std::numeric_limits<double>::infinity();
  }
  return e;
}

// One line per checked quantity of a tensor-core case, "[margin] SUITE CASE QUANTITY error E
// naive N ratio R": how close the case came to the accuracy rule (ratio at most 2, or an error
// within 1e-6 where the naive one is 0), which scripts/device-check.sh gathers into a table of
// the rule's margin on the hardware.
inline void print_margin(const char* name, const char* quantity, double error, double naive) {
  const ::testing::TestInfo* test = ::testing::UnitTest::GetInstance()->current_test_info();
  const char* suite = test != nullptr ? test->test_suite_name() : "-";
  const double ratio = naive > 0.0 ? error / naive : 0.0;
  std::printf("[margin] %s %s %s error %.3e naive %.3e ratio %.3f\n", suite, name, quantity, error,
              naive, ratio);
}

// A result of a 16-bit attention (the update or output, and lse) against the double result of
// the same rounded inputs and a naive implementation in the same precision.
struct RuleCheck {
  const std::vector<double>& out;
  const std::vector<double>& lse;
};

// The result checks of every tensor-core test: the outputs finite, lse -inf exactly for the
// padding queries (exact lse -inf) and finite elsewhere, the exact outputs not near zero (no
// pass on zeros), and the accuracy rule of issue 16 on outputs and lse: the error is at most
// twice the naive one, plus 1e-6 for cases both compute exactly. Returns the naive errors
// {out, lse} for further bounds.
inline std::pair<double, double> expect_accuracy_rule(const char* name, const RuleCheck& got,
                                                      const RuleCheck& exact,
                                                      const RuleCheck& naive) {
  for (std::size_t i = 0; i < got.out.size(); ++i) {
    EXPECT_TRUE(std::isfinite(got.out[i])) << name << ": output " << i << " is " << got.out[i];
    if (!std::isfinite(got.out[i])) break;
  }
  for (std::size_t i = 0; i < got.lse.size(); ++i) {
    if (std::isinf(exact.lse[i])) {
      EXPECT_EQ(got.lse[i], exact.lse[i]) << name << ": lse of padding query " << i;
    } else {
      EXPECT_TRUE(std::isfinite(got.lse[i])) << name << ": lse " << i << " is " << got.lse[i];
    }
  }
  double magnitude = 0.0;
  for (double x : exact.out) magnitude = std::max(magnitude, std::abs(x));
  EXPECT_GT(magnitude, 0.05) << name << ": the outputs must not be near zero";
  const double naive_out = max_difference(naive.out, exact.out);
  const double naive_lse = max_difference(naive.lse, exact.lse);
  const double error_out = max_difference(got.out, exact.out);
  const double error_lse = max_difference(got.lse, exact.lse);
  print_margin(name, "update", error_out, naive_out);
  print_margin(name, "lse", error_lse, naive_lse);
  EXPECT_LE(error_out, 2.0 * naive_out + 1e-6) << name << ": naive error " << naive_out;
  EXPECT_LE(error_lse, 2.0 * naive_lse + 1e-6) << name << ": naive lse error " << naive_lse;
  return {naive_out, naive_lse};
}

// The entropy of a tensor-core result against the double entropy and a naive float one: 0
// exactly for the padding queries (exact lse -inf), finite elsewhere, not all near zero when
// `spread` (more than one key), and at most twice the naive error plus 1e-6. Returns the naive
// error.
inline double expect_entropy_rule(const char* name, const std::vector<double>& got,
                                  const std::vector<double>& exact,
                                  const std::vector<double>& naive,
                                  const std::vector<double>& exact_lse, bool spread) {
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (std::isinf(exact_lse[i])) {
      EXPECT_EQ(got[i], 0.0) << name << ": entropy of padding query " << i;
    } else {
      EXPECT_TRUE(std::isfinite(got[i])) << name << ": entropy " << i << " is " << got[i];
    }
  }
  if (spread) {
    double largest = 0.0;
    for (double x : exact) largest = std::max(largest, x);
    EXPECT_GT(largest, 0.1) << name << ": the entropies must not vanish";
  }
  const double naive_error = max_difference(naive, exact);
  const double error = max_difference(got, exact);
  print_margin(name, "entropy", error, naive_error);
  EXPECT_LE(error, 2.0 * naive_error + 1e-6) << name << ": naive entropy error " << naive_error;
  return naive_error;
}

// ---- Entropy, and the TF32 model (tc_attention_test.cpp, tc_factored_test.cpp) ----

// The operands of a naive TF32 kernel: each value rounded to TF32 (round_to_tf32, as cvt.rna).
// attention(c, tf32(q), tf32(k), tf32(v), ..., true) with c.type = TcType::tf32 is then the
// naive TF32 attention: TF32 operands, float scores, softmax and sums, the probabilities rounded
// to TF32 before the product with TF32 values.
inline std::vector<float> tf32(std::vector<float> values) {
  for (float& v : values) v = round_to_tf32(v);
  return values;
}

}  // namespace emflow::testing
