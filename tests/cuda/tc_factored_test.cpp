// cuda::attend_factored_async and the blocking attend_factored on Device::cuda for bfloat16,
// float16 and float with precision tf32 (the tensor-core path, src/cuda/tc_factored.cpp), at
// awkward sizes (N = 1, 17, 130;
// ranks and dims that leave part of a 16-wide step empty), masks none, causal and window, key
// lengths, key bias, offset, lse and entropy. The accuracy rule (issue 16): against the double
// result of the same rounded inputs, the error is at most twice the error of a naive implementation
// in the same precision (projections in float rounded to the 16-bit type, then the naive attention
// of tc_reference.hpp, the output projection in float, rounded to the 16-bit type; for TF32 the
// projections stay float and the naive attention takes TF32 operands), plus 1e-6; and
// the result agrees with the CPU's 16-bit attend_factored within three times that error.
// Outputs are poisoned (NaN) before each call. Skipped without a device; tests/cuda/emulation
// runs them on the CPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "common/testing.hpp"
#include "core/dispatch.hpp"
#include "emflow/capability.hpp"
#include "emflow/error.hpp"
#include "emflow/factored.hpp"
#include "emflow/precision.hpp"
#include "emflow/types.hpp"

#if defined(EMFLOW_WITH_CUDA)
#include <cuda_runtime.h>

#include "emflow/cuda.hpp"
#include "tc_reference.hpp"

namespace emflow::testing {
namespace {

struct FactoredCase {
  const char* name;
  TcType type;
  int batch, heads, tokens, dim, rank;
  Mask mask;
  std::vector<std::int64_t> key_lengths;  // empty: all keys
  bool bias, offset;
  int kv_heads = 0;    // grouped-query heads: fewer than heads (0: heads)
  int rotary_dim = 0;  // rotated coordinates of the queries and keys (0: none)
  RotaryPairing pairing = RotaryPairing::half_split;

  int key_heads() const { return kv_heads == 0 ? heads : kv_heads; }
  Rotary rotary() const {
    Rotary r;
    r.dim = rotary_dim;
    r.base = 500.0;  // angles that turn visibly over a few positions
    r.pairing = pairing;
    return r;
  }
};

void PrintTo(const FactoredCase& c, std::ostream* os) { *os << c.name; }

// The problem of one head's attention in rank r, as tc_reference.hpp reads it.
struct HeadProblem {
  TcType type;
  int batch, heads, tokens, queries, dim;
  Mask mask;
  std::vector<std::int64_t> key_lengths;
};

struct Inputs {
  Rounded x, a, b, v, u, bias, offset;  // X (B,N,d); A, B, V (H,r,d); U (H,d,r); u (H,d); c (d)
  double beta = 1.0;
};

Inputs make_inputs(const FactoredCase& c) {
  std::mt19937 random(77u + static_cast<unsigned>(c.tokens * 13 + c.dim + c.rank));
  const auto B = static_cast<std::size_t>(c.batch), N = static_cast<std::size_t>(c.tokens);
  const auto d = static_cast<std::size_t>(c.dim), H = static_cast<std::size_t>(c.heads);
  const auto r = static_cast<std::size_t>(c.rank), K = static_cast<std::size_t>(c.key_heads());
  const float range = 1.7f / std::sqrt(static_cast<float>(d));  // projections of order one
  Inputs in;
  in.x = random_rounded(c.type, B * N * d, random);
  in.a = random_rounded(c.type, H * r * d, random, range);
  in.b = random_rounded(c.type, K * r * d, random, range);
  in.v = random_rounded(c.type, K * r * d, random, range);
  in.u = random_rounded(c.type, H * d * r, random, 1.7f / std::sqrt(static_cast<float>(r)));
  if (c.bias) in.bias = random_rounded(c.type, H * d, random, range);
  if (c.offset) in.offset = random_rounded(c.type, d, random, 0.5f);
  in.beta = 2.0 / std::sqrt(static_cast<double>(r));
  return in;
}

struct Expected {
  std::vector<double> update, lse, entropy;  // update (B,N,d), lse and entropy (B,H,N)
};

// naive = false: in double. naive = true: as a straightforward 16-bit kernel would.
Expected factored_attention(const FactoredCase& c, const Inputs& in, bool naive) {
  const int B = c.batch, N = c.tokens, d = c.dim, H = c.heads, r = c.rank;
  const HeadProblem head{c.type, B, H, N, N, r, c.mask, c.key_lengths};
  const bool tf32_case = c.type == TcType::tf32;
  // Per head, rows of X projected by W (H, rows_out, d): (H, B, N, rows_out); naive: in float,
  // rounded to the 16-bit type when `round`. The double result is kept as the nearest float,
  // far below the 16-bit errors tested.
  // Grouped heads: head h projects with map h / (H / K) of w (K maps). Rotary: each row (token
  // n of its cloud, at position n: self-attention, key_position 0) turned before the rounding,
  // in double for the exact result and in float for the naive one.
  const int K = c.key_heads();
  const Rotary rotary = c.rotary();
  const std::vector<double> frequencies =
      c.rotary_dim != 0 ? rotary_inverse_frequencies(rotary, 1) : std::vector<double>{};
  auto project = [&](const Rounded& w, int maps, int rows_out, bool round, bool turn) {
    std::vector<float> out(static_cast<std::size_t>(H) * B * N * rows_out);
    std::vector<double> exact(static_cast<std::size_t>(rows_out));
    std::vector<float> rounded(static_cast<std::size_t>(rows_out));
    for (int h = 0; h < H; ++h) {
      const int map = h / (H / maps);
      for (int row = 0; row < B * N; ++row) {
        for (int k = 0; k < rows_out; ++k) {
          float sum_f = 0.f;
          double sum = 0.0;
          for (int a = 0; a < d; ++a) {
            const float wa = w.values[(static_cast<std::size_t>(map) * rows_out + k) * d + a];
            const float xa = in.x.values[static_cast<std::size_t>(row) * d + a];
            sum_f += wa * xa;
            sum += static_cast<double>(wa) * xa;
          }
          exact[static_cast<std::size_t>(k)] = sum;
          rounded[static_cast<std::size_t>(k)] = sum_f;
        }
        if (turn && c.rotary_dim != 0) {
          const int half = c.rotary_dim / 2;
          const bool interleaved = c.pairing == RotaryPairing::interleaved;
          for (int t = 0; t < half; ++t) {
            const auto first = static_cast<std::size_t>(interleaved ? 2 * t : t);
            const auto second = static_cast<std::size_t>(interleaved ? 2 * t + 1 : t + half);
            const double angle = (row % N) * frequencies[static_cast<std::size_t>(t)];
            const double cosine = std::cos(angle), sine = std::sin(angle);
            const double x = exact[first], y = exact[second];
            exact[first] = x * cosine - y * sine;
            exact[second] = y * cosine + x * sine;
            const float xf = rounded[first], yf = rounded[second];
            const auto cf = static_cast<float>(cosine), sf = static_cast<float>(sine);
            rounded[first] = xf * cf - yf * sf;
            rounded[second] = yf * cf + xf * sf;
          }
        }
        for (int k = 0; k < rows_out; ++k) {
          const float sum_f = rounded[static_cast<std::size_t>(k)];
          out[(static_cast<std::size_t>(h) * B * N + row) * rows_out + k] =
              naive ? (round && !tf32_case ? round_to(c.type, sum_f) : sum_f)
                    : static_cast<float>(exact[static_cast<std::size_t>(k)]);
        }
      }
    }
    return out;
  };
  std::vector<float> q = project(in.a, H, r, true, true), k = project(in.b, K, r, true, true),
                     v = project(in.v, K, r, true, false);
  if (naive && tf32_case) {  // the naive TF32 kernel's operands (tc_reference.hpp)
    q = tf32(q);
    k = tf32(k);
    v = tf32(v);
  }
  std::vector<float> bias;
  if (c.bias) bias = project(in.bias, H, 1, false, false);
  const float scale = static_cast<float>(in.beta * 1.4426950408889634);
  const Result heads = attention(head, q, k, v, bias, scale, naive);

  Expected e;
  e.update.assign(static_cast<std::size_t>(B) * N * d, 0.0);
  e.lse.assign(static_cast<std::size_t>(B) * H * N, 0.0);
  e.entropy.assign(e.lse.size(), 0.0);
  for (int b = 0; b < B; ++b) {
    for (int i = 0; i < N; ++i) {
      for (int h = 0; h < H; ++h) {
        const std::size_t to = (static_cast<std::size_t>(b) * H + h) * N + i;
        e.lse[to] = heads.lse[(static_cast<std::size_t>(h) * B + b) * N + i];
        e.entropy[to] = heads.entropy[(static_cast<std::size_t>(h) * B + b) * N + i];
      }
      if (std::isinf(heads.lse[static_cast<std::size_t>(b) * N + i])) continue;  // padding
      for (int a = 0; a < d; ++a) {
        double sum = 0.0;
        float sum_f = 0.f;
        for (int h = 0; h < H; ++h) {
          const double* o = &heads.out[((static_cast<std::size_t>(h) * B + b) * N + i) * r];
          for (int t = 0; t < r; ++t) {
            const float up = in.u.values[(static_cast<std::size_t>(h) * d + a) * r + t];
            sum += up * o[t];
            sum_f += up * static_cast<float>(o[t]);
          }
        }
        if (c.offset) {
          sum += in.offset.values[static_cast<std::size_t>(a)];
          sum_f += in.offset.values[static_cast<std::size_t>(a)];
        }
        e.update[static_cast<std::size_t>(b) * N * d + static_cast<std::size_t>(i) * d + a] =
            naive ? (tf32_case ? sum_f : round_to(c.type, sum_f)) : sum;
      }
    }
  }
  return e;
}

template <class T>
struct HostProblem {
  std::vector<T> x, a, b, u, v, bias, offset;
  FactoredLayer<T> layer;
  AttentionInput<T> input;

  HostProblem(const FactoredCase& c, const Inputs& in)
      : x(as_type<T>(in.x)),
        a(as_type<T>(in.a)),
        b(as_type<T>(in.b)),
        u(as_type<T>(in.u)),
        v(as_type<T>(in.v)),
        bias(as_type<T>(in.bias)),
        offset(as_type<T>(in.offset)) {
    layer = {c.heads,
             c.rank,
             a.data(),
             b.data(),
             u.data(),
             v.data(),
             c.bias ? bias.data() : nullptr,
             c.offset ? offset.data() : nullptr};
    layer.kv_heads = c.kv_heads;
    layer.rotary = c.rotary();
    input.cloud = x.data();
    input.batch = c.batch;
    input.tokens = c.tokens;
    input.dim = c.dim;
    input.beta = in.beta;
    input.mask = c.mask;
    input.key_lengths = c.key_lengths.empty() ? nullptr : c.key_lengths.data();
  }
};

template <class T>
std::vector<double> widened(const std::vector<T>& values) {
  std::vector<double> out;
  for (const T& value : values) out.push_back(as_float(value));
  return out;
}

// What cuda::attend_factored_async wrote, copied back.
template <class T>
struct AsyncResult {
  std::vector<T> update;
  std::vector<float> lse, entropy;
  int key_splits = 0;  // of the plan the options make
};

// One case through cuda::attend_factored_async with `options` on device copies of `host`, on a
// stream of its own (destroyed on every path), the outputs poisoned with NaN first. Empty after
// a CUDA failure (recorded).
template <class T>
AsyncResult<T> run_async(const FactoredCase& c, const HostProblem<T>& host,
                         const cuda::PlanOptions& options) {
  const auto B = static_cast<std::size_t>(c.batch), N = static_cast<std::size_t>(c.tokens);
  const auto d = static_cast<std::size_t>(c.dim), H = static_cast<std::size_t>(c.heads);
  const auto K = static_cast<std::size_t>(c.key_heads()), r = static_cast<std::size_t>(c.rank);
  struct OwnedStream {
    cudaStream_t stream = nullptr;
    ~OwnedStream() {
      if (stream != nullptr) cudaStreamDestroy(stream);
    }
  } owned;
  if (cudaStreamCreateWithFlags(&owned.stream, cudaStreamNonBlocking) != cudaSuccess) {
    ADD_FAILURE() << c.name << ": cudaStreamCreateWithFlags failed";
    return {};
  }
  const cudaStream_t stream = owned.stream;
  cuda::DeviceBuffer<T> dx(B * N * d), da(H * r * d), db(K * r * d), du(H * d * r), dv(K * r * d),
      dbias(H * d), doffset(d), dupdate(B * N * d);
  cuda::DeviceBuffer<float> dlse(B * H * N), dentropy(B * H * N);
  cuda::DeviceBuffer<std::int64_t> dlengths(B);
  dx.copy_from_host(host.x.data(), host.x.size(), stream);
  da.copy_from_host(host.a.data(), host.a.size(), stream);
  db.copy_from_host(host.b.data(), host.b.size(), stream);
  du.copy_from_host(host.u.data(), host.u.size(), stream);
  dv.copy_from_host(host.v.data(), host.v.size(), stream);
  if (c.bias) dbias.copy_from_host(host.bias.data(), host.bias.size(), stream);
  if (c.offset) doffset.copy_from_host(host.offset.data(), host.offset.size(), stream);
  if (!c.key_lengths.empty()) dlengths.copy_from_host(c.key_lengths.data(), B, stream);
  const std::vector<T> poison_update(dupdate.size(), poison<T>());
  const std::vector<float> poison_lse(dlse.size(), std::nanf(""));
  dupdate.copy_from_host(poison_update.data(), poison_update.size(), stream);
  dlse.copy_from_host(poison_lse.data(), poison_lse.size(), stream);
  dentropy.copy_from_host(poison_lse.data(), poison_lse.size(), stream);
  AttentionInput<T> input = host.input;
  input.cloud = dx.data();
  input.key_lengths = c.key_lengths.empty() ? nullptr : dlengths.data();
  FactoredLayer<T> layer = host.layer;
  layer.query_factor = da.data();
  layer.key_factor = db.data();
  layer.content_up = du.data();
  layer.content_down = dv.data();
  layer.key_bias = c.bias ? dbias.data() : nullptr;
  layer.offset = c.offset ? doffset.data() : nullptr;
  const AttentionOutput<T> output{dupdate.data(), dlse.data(), dentropy.data()};
  AsyncResult<T> result;
  result.key_splits = cuda::AttentionPlan<T>(input, layer, output, options).key_splits();
  const std::size_t bytes = cuda::attend_factored_workspace_size(input, layer, output, options);
  cuda::DeviceBuffer<unsigned char> workspace(bytes);
  cuda::attend_factored_async(input, layer, output, workspace.data(), bytes, stream, options);
  result.update.resize(dupdate.size());
  result.lse.resize(dlse.size());
  result.entropy.resize(dentropy.size());
  dupdate.copy_to_host(result.update.data(), result.update.size(), stream);
  dlse.copy_to_host(result.lse.data(), result.lse.size(), stream);
  dentropy.copy_to_host(result.entropy.data(), result.entropy.size(), stream);
  if (cudaStreamSynchronize(stream) != cudaSuccess) {
    ADD_FAILURE() << c.name << ": cudaStreamSynchronize failed";
    return {};
  }
  return result;
}

// One case through cuda::attend_factored_async with PlanOptions::key_splits = `key_splits` (0:
// the automatic choice, which the blocking form makes too, so their bits agree; else the blocking
// form's result is held to the rule's bound instead, and the plan must take that many splits).
template <class T>
void check_case(const FactoredCase& c, int key_splits = 0) {
  const Inputs in = make_inputs(c);
  const HostProblem<T> host(c, in);
  const cuda::PlanOptions options{cuda::Algorithm::automatic, tensor_core_precision<T>(),
                                  key_splits};
  const AsyncResult<T> run = run_async(c, host, options);
  ASSERT_FALSE(run.update.empty()) << c.name;
  if (key_splits != 0) {
    EXPECT_EQ(run.key_splits, key_splits) << c.name;
  }
  const std::vector<T>& update = run.update;
  const std::vector<float>&lse = run.lse, &entropy = run.entropy;

  // The blocking form on the host arrays: the same kernels, so the same bits.
  std::vector<T> blocking_update(update.size(), poison<T>());
  std::vector<float> blocking_lse(lse.size(), std::nanf("")),
      blocking_entropy(lse.size(), std::nanf(""));
  attend_factored(
      host.input, host.layer,
      AttentionOutput<T>{blocking_update.data(), blocking_lse.data(), blocking_entropy.data()},
      {Device::cuda, 0, options.precision});
  if (key_splits == 0) {
    expect_same_bits(c.name, "update", blocking_update, update);
    expect_same_bits(c.name, "lse", blocking_lse, lse);
    expect_same_bits(c.name, "entropy", blocking_entropy, entropy);
  }

  // The CPU's 16-bit path on the same arrays.
  std::vector<T> cpu_update(update.size(), poison<T>());
  std::vector<float> cpu_lse(lse.size(), std::nanf("")), cpu_entropy(lse.size(), std::nanf(""));
  attend_factored(host.input, host.layer,
                  AttentionOutput<T>{cpu_update.data(), cpu_lse.data(), cpu_entropy.data()},
                  {Device::cpu});

  const Expected exact = factored_attention(c, in, false);
  const Expected naive = factored_attention(c, in, true);
  const std::vector<double> got = widened(update), got_lse(lse.begin(), lse.end()),
                            got_entropy(entropy.begin(), entropy.end());
  const auto [naive_error, naive_lse_error] = expect_accuracy_rule(
      c.name, {got, got_lse}, {exact.update, exact.lse}, {naive.update, naive.lse});
  const std::vector<double> cpu = widened(cpu_update), cpu_lse_d(cpu_lse.begin(), cpu_lse.end());
  EXPECT_LE(max_difference(got, cpu), 3.0 * naive_error + 1e-6) << c.name << ": against the CPU";
  EXPECT_LE(max_difference(got_lse, cpu_lse_d), 3.0 * naive_lse_error + 1e-6)
      << c.name << ": lse against the CPU";
  const double naive_entropy_error = expect_entropy_rule(c.name, got_entropy, exact.entropy,
                                                         naive.entropy, exact.lse, c.tokens > 1);
  const std::vector<double> cpu_entropy_d(cpu_entropy.begin(), cpu_entropy.end());
  EXPECT_LE(max_difference(got_entropy, cpu_entropy_d), 3.0 * naive_entropy_error + 1e-6)
      << c.name << ": entropy against the CPU";
  if (key_splits != 0) {
    // The keys split otherwise than the blocking form's automatic choice (none, for
    // self-attention): another order of the sums, within the rule's bound.
    EXPECT_LE(max_difference(got, widened(blocking_update)), 2.0 * naive_error + 1e-6)
        << c.name << ": " << key_splits << " splits against none";
    EXPECT_LE(
        max_difference(got_lse, std::vector<double>(blocking_lse.begin(), blocking_lse.end())),
        2.0 * naive_lse_error + 1e-6)
        << c.name << ": lse, " << key_splits << " splits against none";
    EXPECT_LE(max_difference(got_entropy,
                             std::vector<double>(blocking_entropy.begin(), blocking_entropy.end())),
              2.0 * naive_entropy_error + 1e-6)
        << c.name << ": entropy, " << key_splits << " splits against none";
  }
}

class TcFactored : public ::testing::TestWithParam<FactoredCase> {};

TEST_P(TcFactored, MatchesTheDoubleResultWithinTwiceTheNaiveErrorAndTheCpu) {
  EMFLOW_REQUIRE_CUDA();
  const FactoredCase& c = GetParam();
  with_storage_type(c.type, [&](auto stored_type) { check_case<decltype(stored_type)>(c); });
}

// name, type, batch, heads, tokens, dim, rank, mask, key lengths, key bias, offset
INSTANTIATE_TEST_SUITE_P(
    Cases, TcFactored,
    ::testing::Values(
        FactoredCase{"bf16_N1_d24_r16_none", kBf16, 1, 1, 1, 24, 16, kNone, {}, false, true},
        FactoredCase{
            "f16_N17_d40_r24_causal_bias", kF16, 2, 2, 17, 40, 24, kCausal, {17, 9}, true, true},
        FactoredCase{
            "bf16_N17_d32_r40_window5_len", kBf16, 2, 1, 17, 32, 40, kWindow5, {5, 0}, true, false},
        FactoredCase{"f16_N130_d48_r32_none_len", kF16, 1, 2, 130, 48, 32, kNone, {97}, true, true},
        FactoredCase{"bf16_N130_d20_r8_causal", kBf16, 1, 1, 130, 20, 8, kCausal, {}, false, false},
        FactoredCase{"tf32_N1_d12_r4_none", kTf32, 1, 1, 1, 12, 4, kNone, {}, false, true},
        FactoredCase{
            "tf32_N17_d40_r20_causal_len", kTf32, 2, 2, 17, 40, 20, kCausal, {17, 0}, true, true},
        FactoredCase{
            "tf32_N130_d24_r36_window5_len", kTf32, 1, 1, 130, 24, 36, kWindow5, {97}, true, false},
        FactoredCase{"tf32_N70_d16_r130_none", kTf32, 1, 1, 70, 16, 130, kNone, {}, false, true},
        // Rotary positions (half-split and interleaved, over the whole rank and part of it) and
        // grouped kv heads, alone and together.
        FactoredCase{"bf16_N130_d32_r16_causal_rotary16_kv2of4",
                     kBf16,
                     1,
                     4,
                     130,
                     32,
                     16,
                     kCausal,
                     {},
                     false,
                     true,
                     2,
                     16},
        FactoredCase{"f16_N17_d40_r24_window5_len_rotary8_interleaved",
                     kF16,
                     2,
                     2,
                     17,
                     40,
                     24,
                     kWindow5,
                     {17, 6},
                     true,
                     false,
                     0,
                     8,
                     RotaryPairing::interleaved},
        FactoredCase{"bf16_N70_d24_r32_none_len_kv1of3",
                     kBf16,
                     2,
                     3,
                     70,
                     24,
                     32,
                     kNone,
                     {70, 33},
                     false,
                     true,
                     1},
        FactoredCase{"tf32_N130_d20_r36_causal_len_rotary36_kv2of6",
                     kTf32,
                     1,
                     6,
                     130,
                     20,
                     36,
                     kCausal,
                     {101},
                     true,
                     true,
                     2,
                     36}),
    [](const ::testing::TestParamInfo<FactoredCase>& info) {
      return std::string(info.param.name);
    });

// Key splits asked for on the factored form (PlanOptions::key_splits; the rule never splits
// self-attention): the float kernel's merge of the splits' partial states, within the rule of the
// double result and of the unsplit one, with key lengths, a window and a cloud of no key.
TEST(TcFactoredSplits, RequestedSplitsAgreeWithTheUnsplitResultWithinTheRule) {
  EMFLOW_REQUIRE_CUDA();
  check_case<bfloat16>(
      FactoredCase{
          "bf16_N130_d24_r16_causal_len", kBf16, 2, 2, 130, 24, 16, kCausal, {130, 70}, true, true},
      3);
  check_case<float16>(
      FactoredCase{
          "f16_N200_d20_r40_window5_len", kF16, 2, 1, 200, 20, 40, kWindow5, {200, 0}, false, true},
      2);
  check_case<float>(
      FactoredCase{"tf32_N130_d16_r36_none", kTf32, 1, 2, 130, 16, 36, kNone, {}, true, false}, 3);
}

// A layer with rotary positions or grouped kv heads in float with Precision::fp32: the
// projections in float32 and the SDPA operator's float32 kernel (kernels/sdpa_backward.cu),
// never expanded. Against the double result (the projections rounded to float once, as the
// kernel stores them) within float rounding, and against the CPU engine; the stream-ordered plan
// gives the blocking call's bits. The inputs are the tf32 cases' (TF32-exact values: the
// projected queries and keys are full floats all the same).
TEST(TcFactoredFloat32, RotaryAndGroupedLayersMatchTheDoubleResult) {
  EMFLOW_REQUIRE_CUDA();
  const FactoredCase cases[] = {
      {"fp32_N130_d32_r16_causal_rotary16_kv2of4",
       kTf32,
       1,
       4,
       130,
       32,
       16,
       kCausal,
       {},
       false,
       true,
       2,
       16},
      {"fp32_N70_d40_r24_window5_len_bias_rotary8_interleaved",
       kTf32,
       2,
       2,
       70,
       40,
       24,
       kWindow5,
       {70, 6},
       true,
       false,
       0,
       8,
       RotaryPairing::interleaved},
      {"fp32_N70_d24_r32_none_len_kv1of3",
       kTf32,
       2,
       3,
       70,
       24,
       32,
       kNone,
       {70, 33},
       false,
       true,
       1},
      {"fp32_N90_d20_r128_causal_len_bias_rotary36_kv2of6",
       kTf32,
       1,
       6,
       90,
       20,
       128,
       kCausal,
       {81},
       true,
       true,
       2,
       36},
  };
  const ExecutionOptions options{Device::cuda, 0, Precision::fp32};
  for (const FactoredCase& c : cases) {
    SCOPED_TRACE(c.name);
    const Inputs in = make_inputs(c);
    const HostProblem<float> host(c, in);
    const auto B = static_cast<std::size_t>(c.batch), N = static_cast<std::size_t>(c.tokens);
    const auto d = static_cast<std::size_t>(c.dim), H = static_cast<std::size_t>(c.heads);
    std::vector<float> update(B * N * d, std::nanf("")), lse(B * H * N, std::nanf("")),
        entropy(B * H * N, std::nanf(""));
    attend_factored(host.input, host.layer,
                    AttentionOutput<float>{update.data(), lse.data(), entropy.data()}, options);
    const Route& r = detail::last_route();
    EXPECT_EQ(r.device, Device::cuda);
    EXPECT_EQ(r.kernel, Kernel::cuda_fused);
    EXPECT_FALSE(r.expanded);

    const Expected exact = factored_attention(c, in, false);
    const std::vector<double> got(update.begin(), update.end()), got_lse(lse.begin(), lse.end()),
        got_entropy(entropy.begin(), entropy.end());
    EXPECT_LE(max_difference(got, exact.update), 2e-5);
    EXPECT_LE(max_difference(got_lse, exact.lse), 2e-5);
    EXPECT_LE(max_difference(got_entropy, exact.entropy), 1e-4);

    std::vector<float> cpu(update.size(), std::nanf("")), cpu_lse(lse.size(), std::nanf(""));
    attend_factored(host.input, host.layer, AttentionOutput<float>{cpu.data(), cpu_lse.data()},
                    {Device::cpu});
    EXPECT_LE(max_difference(got, std::vector<double>(cpu.begin(), cpu.end())), 2e-5);

    // The plan on device copies, on a stream: the blocking call's bits.
    const AsyncResult<float> run =
        run_async(c, host, {cuda::Algorithm::automatic, Precision::fp32});
    ASSERT_FALSE(run.update.empty()) << c.name;
    EXPECT_EQ(run.key_splits, 1) << c.name;
    expect_same_bits(c.name, "update", update, run.update);
    expect_same_bits(c.name, "lse", lse, run.lse);
    expect_same_bits(c.name, "entropy", entropy, run.entropy);
  }
}

// The tensor-core path does not compute the weights: refused by name before any device work
// (these checks run without a device).
TEST(TcFactoredRefusals, WeightsAreUnsupportedByName) {
  const FactoredCase c{"refusal", kBf16, 1, 1, 3, 4, 2, kNone, {}, false, false};
  const Inputs in = make_inputs(c);
  const HostProblem<bfloat16> host(c, in);
  std::vector<bfloat16> update(12);
  std::vector<float> weights(9);
  const auto refusal = [&](const AttentionOutput<bfloat16>& output) {
    try {
      unsigned char workspace[256];
      cuda::attend_factored_async(host.input, host.layer, output, workspace, sizeof workspace,
                                  nullptr);
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::unsupported) << e.what();
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_NE(refusal({update.data(), nullptr, nullptr, weights.data()})
                .find("tensor cores do not form the weights"),
            std::string::npos);
}

// The precision must suit the storage type: tf32 needs float, bf16 and fp16 their own type;
// refused by name before any device work. float with fp32 is not refused: it runs the layer
// expanded to dense operators (tests/cuda/cuda_plan_test.cpp checks its values; with rotary
// positions or grouped heads the float32 kernel above), as its workspace size says.
TEST(TcFactoredRefusals, PrecisionsThatDoNotSuitTheTypeAreRefusedByName) {
  const FactoredCase c{"refusal", kTf32, 1, 1, 3, 4, 2, kNone, {}, false, false};
  const Inputs in = make_inputs(c);
  const HostProblem<float> host(c, in);
  std::vector<float> update(12);
  const auto code_and_message = [](auto call) {
    try {
      call();
    } catch (const Error& e) {
      return std::string(to_string(e.code())) + ": " + e.what();
    }
    return std::string("accepted");
  };
  unsigned char workspace[256];
  const AttentionOutput<float> output{update.data()};
  const auto with = [&](Precision p) {
    return code_and_message([&] {
      cuda::attend_factored_async(host.input, host.layer, output, workspace, sizeof workspace,
                                  nullptr, {cuda::Algorithm::automatic, p});
    });
  };
  const std::string bf16 = with(Precision::bf16);
  EXPECT_EQ(bf16.rfind("invalid_argument", 0), 0u) << bf16;
  EXPECT_NE(bf16.find("'precision'"), std::string::npos) << bf16;
  const std::string size = code_and_message(
      [&] { EXPECT_GT(cuda::attend_factored_workspace_size(host.input, host.layer, output), 0u); });
  EXPECT_EQ(size, "accepted") << size;

  const FactoredCase c16{"refusal", kBf16, 1, 1, 3, 4, 2, kNone, {}, false, false};
  const HostProblem<bfloat16> host16(c16, make_inputs(c16));
  std::vector<bfloat16> update16(12);
  for (Precision p : {Precision::tf32, Precision::fp16}) {
    const std::string refused = code_and_message([&] {
      cuda::attend_factored_async(host16.input, host16.layer,
                                  AttentionOutput<bfloat16>{update16.data()}, workspace,
                                  sizeof workspace, nullptr, {cuda::Algorithm::automatic, p});
    });
    EXPECT_EQ(refused.rfind("invalid_argument", 0), 0u) << refused;
    EXPECT_NE(refused.find("'precision'"), std::string::npos) << refused;
  }
}

}  // namespace
}  // namespace emflow::testing
#endif
