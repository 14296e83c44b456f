// cuda::attend_async and the blocking attend on Device::cuda for bfloat16 and float16, and for
// float with precision tf32: the dense EMF form on the tensor cores (src/cuda/tc_dense.cpp), at
// awkward sizes (N = 1, 7, 33, 130; d = 1, 5, 64, 130), masks none, causal and window, key lengths,
// cross-attention, key bias, offset, with and without lse and entropy. The accuracy rule (issue 16,
// tc_reference.hpp): against the double result of the same rounded inputs, the error is at most
// twice the error of a naive implementation in the same precision (R_h = Q M_h and C_h = X F_h^T in
// float rounded to the 16-bit type, the naive attention of tc_reference.hpp against the keys X, the
// sum over heads and the offset in float rounded to the 16-bit type; for TF32 the projections stay
// float and the attention reads them rounded to TF32, tc_reference.hpp's naive TF32 model). Outputs
// are poisoned (NaN) before each call; the blocking call gives the stream-ordered one's bits.
// Skipped without a device; tests/cuda/emulation runs them on the CPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <ostream>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "common/testing.hpp"
#include "emflow/attention.hpp"
#include "emflow/error.hpp"
#include "emflow/precision.hpp"
#include "emflow/types.hpp"

#if defined(EMFLOW_WITH_CUDA)
#include <cuda_runtime.h>

#include "emflow/cuda.hpp"
#include "tc_reference.hpp"

namespace emflow::testing {
namespace {

struct DenseCase {
  const char* name;
  TcType type;
  int batch, heads, tokens, cross_queries, dim;  // cross_queries 0: self-attention
  Mask mask;
  std::vector<std::int64_t> key_lengths;  // empty: all keys (self-attention only)
  bool bias, offset, lse;
};

void PrintTo(const DenseCase& c, std::ostream* os) { *os << c.name; }

int query_rows(const DenseCase& c) { return c.cross_queries > 0 ? c.cross_queries : c.tokens; }

// One head's attention in dim d, as tc_reference.hpp reads it (queries R_h, keys X, values C_h).
struct HeadProblem {
  TcType type;
  int batch, heads, tokens, queries, dim;
  Mask mask;
  std::vector<std::int64_t> key_lengths;
};

struct Inputs {
  Rounded x, q, m, f, u, offset;  // X (B,N,d); Q (B,Nq,d); M, F (H,d,d); u (H,d); c (d)
  double beta = 1.0;
};

Inputs make_inputs(const DenseCase& c) {
  std::mt19937 random(91u + static_cast<unsigned>(c.tokens * 31 + c.dim * 7 + c.heads));
  const auto B = static_cast<std::size_t>(c.batch), N = static_cast<std::size_t>(c.tokens);
  const auto d = static_cast<std::size_t>(c.dim), H = static_cast<std::size_t>(c.heads);
  const float range = 1.7f / std::sqrt(static_cast<float>(d));  // projections of order one
  Inputs in;
  in.x = random_rounded(c.type, B * N * d, random);
  if (c.cross_queries > 0) {
    in.q = random_rounded(c.type, B * static_cast<std::size_t>(c.cross_queries) * d, random);
  }
  in.m = random_rounded(c.type, H * d * d, random, range);
  in.f = random_rounded(c.type, H * d * d, random, range);
  if (c.bias) in.u = random_rounded(c.type, H * d, random, range);
  if (c.offset) in.offset = random_rounded(c.type, d, random, 0.5f);
  in.beta = 2.0 / std::sqrt(static_cast<double>(d));
  return in;
}

struct Expected {
  std::vector<double> update, lse, entropy;  // update (B,Nq,d), lse and entropy (B,H,Nq)
};

// naive = false: in double. naive = true: as a straightforward 16-bit kernel would.
Expected dense_attention(const DenseCase& c, const Inputs& in, bool naive) {
  const int B = c.batch, N = c.tokens, Nq = query_rows(c), d = c.dim, H = c.heads;
  const HeadProblem head{c.type, B, H, N, Nq, d, c.mask, c.key_lengths};
  const Rounded& queries = c.cross_queries > 0 ? in.q : in.x;
  const bool tf32_case = c.type == TcType::tf32;
  // Per head, the rows of `x` mapped by W (H, outputs, d) (entry (h, o, k) at `at(h, o, k)`):
  // (H, rows, outputs); naive: in float, rounded to the 16-bit type when `round`. The double
  // result is kept as the nearest float, far below the 16-bit errors tested.
  auto project = [&](const Rounded& x, int rows, const Rounded& w, int outputs, auto at,
                     bool round) {
    std::vector<float> out(static_cast<std::size_t>(H) * rows * outputs);
    for (int h = 0; h < H; ++h) {
      for (int row = 0; row < rows; ++row) {
        for (int o = 0; o < outputs; ++o) {
          float sum_f = 0.f;
          double sum = 0.0;
          for (int k = 0; k < d; ++k) {
            const float wk = w.values[at(h, o, k)];
            const float xk = x.values[static_cast<std::size_t>(row) * d + k];
            sum_f += wk * xk;
            sum += static_cast<double>(wk) * xk;
          }
          out[(static_cast<std::size_t>(h) * rows + row) * outputs + o] =
              naive ? (round && !tf32_case ? round_to(c.type, sum_f) : sum_f)
                    : static_cast<float>(sum);
        }
      }
    }
    return out;
  };
  const auto dd = static_cast<std::size_t>(d);
  // r_i = M^T q_i: entry (h, o, k) of M^T is M[h][k][o]; c_j = F x_j; u_h^T x_j.
  const auto transposed = [dd](int h, int o, int k) { return (h * dd + k) * dd + o; };
  const auto rows_of = [dd](int h, int o, int k) { return (h * dd + o) * dd + k; };
  const auto bias_of = [dd](int h, int, int k) { return h * dd + k; };
  std::vector<float> r = project(queries, B * Nq, in.m, d, transposed, true);
  std::vector<float> v = project(in.x, B * N, in.f, d, rows_of, true);
  std::vector<float> bias;
  if (c.bias) bias = project(in.x, B * N, in.u, 1, bias_of, false);
  std::vector<float> keys;  // X for every head
  for (int h = 0; h < H; ++h) keys.insert(keys.end(), in.x.values.begin(), in.x.values.end());
  if (naive && tf32_case) {  // the naive TF32 kernel's operands (tc_reference.hpp)
    r = tf32(r);
    keys = tf32(keys);
    v = tf32(v);
  }
  const float scale = static_cast<float>(in.beta * 1.4426950408889634);
  const Result heads = attention(head, r, keys, v, bias, scale, naive);

  Expected e;
  e.update.assign(static_cast<std::size_t>(B) * Nq * d, 0.0);
  if (c.lse) e.lse.assign(static_cast<std::size_t>(B) * H * Nq, 0.0);
  e.entropy.assign(e.lse.size(), 0.0);
  for (int b = 0; b < B; ++b) {
    for (int i = 0; i < Nq; ++i) {
      for (int h = 0; c.lse && h < H; ++h) {
        const std::size_t to = (static_cast<std::size_t>(b) * H + h) * Nq + i;
        const std::size_t from = (static_cast<std::size_t>(h) * B + b) * Nq + i;
        e.lse[to] = heads.lse[from];
        e.entropy[to] = heads.entropy[from];
      }
      if (std::isinf(heads.lse[static_cast<std::size_t>(b) * Nq + i])) continue;  // no key
      for (int a = 0; a < d; ++a) {
        double sum = 0.0;
        float sum_f = 0.f;
        for (int h = 0; h < H; ++h) {
          const double o = heads.out[((static_cast<std::size_t>(h) * B + b) * Nq + i) * d + a];
          sum += o;
          sum_f += static_cast<float>(o);
        }
        if (c.offset) {
          sum += in.offset.values[static_cast<std::size_t>(a)];
          sum_f += in.offset.values[static_cast<std::size_t>(a)];
        }
        e.update[(static_cast<std::size_t>(b) * Nq + i) * d + a] =
            naive ? (tf32_case ? sum_f : round_to(c.type, sum_f)) : sum;
      }
    }
  }
  return e;
}

// The exponent of half a unit in the last place relative to |x|: 2^-8 (bf16), 2^-11 (fp16),
// 2^-24 (float).
template <class T>
constexpr int kHalfUlpExponent = std::is_same_v<T, bfloat16>  ? -8
                                 : std::is_same_v<T, float16> ? -11
                                                              : -24;

template <class T>
struct HostProblem {
  std::vector<T> x, q, m, f, u, offset;
  AttentionInput<T> input;

  HostProblem(const DenseCase& c, const Inputs& in)
      : x(as_type<T>(in.x)),
        q(as_type<T>(in.q)),
        m(as_type<T>(in.m)),
        f(as_type<T>(in.f)),
        u(as_type<T>(in.u)),
        offset(as_type<T>(in.offset)) {
    input.cloud = x.data();
    input.batch = c.batch;
    input.tokens = c.tokens;
    input.dim = c.dim;
    input.layer = {c.heads, m.data(), f.data(), c.bias ? u.data() : nullptr,
                   c.offset ? offset.data() : nullptr};
    input.beta = in.beta;
    input.mask = c.mask;
    input.key_lengths = c.key_lengths.empty() ? nullptr : c.key_lengths.data();
    if (c.cross_queries > 0) {
      input.queries = q.data();
      input.query_tokens = c.cross_queries;
    }
  }
};

// The stream outlives the buffers and is destroyed on every path (a failed assertion returns).
struct OwnedStream {
  cudaStream_t stream = nullptr;
  ~OwnedStream() {
    if (stream != nullptr) cudaStreamDestroy(stream);
  }
};

// One case through cuda::attend_async with PlanOptions::key_splits = `key_splits` (0: the
// automatic choice, which the blocking form makes too, so their bits agree; else the blocking
// form's automatic result is held to the rule's bound instead). *splits_taken: the plan's splits.
// A split run is run twice: the merge's fixed order gives the same bits.
template <class T>
void check_case(const DenseCase& c, int key_splits = 0, int* splits_taken = nullptr) {
  const Inputs in = make_inputs(c);
  const HostProblem<T> host(c, in);
  const auto B = static_cast<std::size_t>(c.batch), N = static_cast<std::size_t>(c.tokens);
  const auto Nq = static_cast<std::size_t>(query_rows(c));
  const auto d = static_cast<std::size_t>(c.dim), H = static_cast<std::size_t>(c.heads);

  OwnedStream owned;
  ASSERT_EQ(cudaStreamCreateWithFlags(&owned.stream, cudaStreamNonBlocking), cudaSuccess);
  const cudaStream_t stream = owned.stream;
  cuda::DeviceBuffer<T> dx(B * N * d), dq(host.q.size()), dm(H * d * d), df(H * d * d), du(H * d),
      doffset(d), dupdate(B * Nq * d);
  cuda::DeviceBuffer<float> dlse(B * H * Nq), dentropy(B * H * Nq);
  cuda::DeviceBuffer<std::int64_t> dlengths(B);
  dx.copy_from_host(host.x.data(), host.x.size(), stream);
  if (!host.q.empty()) dq.copy_from_host(host.q.data(), host.q.size(), stream);
  dm.copy_from_host(host.m.data(), host.m.size(), stream);
  df.copy_from_host(host.f.data(), host.f.size(), stream);
  if (c.bias) du.copy_from_host(host.u.data(), host.u.size(), stream);
  if (c.offset) doffset.copy_from_host(host.offset.data(), host.offset.size(), stream);
  if (!c.key_lengths.empty()) dlengths.copy_from_host(c.key_lengths.data(), B, stream);
  const std::vector<T> poison_update(dupdate.size(), poison<T>());
  const std::vector<float> poison_lse(dlse.size(), std::nanf(""));
  dupdate.copy_from_host(poison_update.data(), poison_update.size(), stream);
  dlse.copy_from_host(poison_lse.data(), poison_lse.size(), stream);
  dentropy.copy_from_host(poison_lse.data(), poison_lse.size(), stream);
  AttentionInput<T> input = host.input;
  input.cloud = dx.data();
  input.queries = host.q.empty() ? nullptr : dq.data();
  input.layer = {c.heads, dm.data(), df.data(), c.bias ? du.data() : nullptr,
                 c.offset ? doffset.data() : nullptr};
  input.key_lengths = c.key_lengths.empty() ? nullptr : dlengths.data();
  // lse and entropy are asked together (a case without them checks the update alone).
  const AttentionOutput<T> output{dupdate.data(), c.lse ? dlse.data() : nullptr,
                                  c.lse ? dentropy.data() : nullptr};
  constexpr Precision precision = tensor_core_precision<T>();
  constexpr cuda::Algorithm automatic = cuda::Algorithm::automatic;
  const cuda::PlanOptions options{automatic, precision, key_splits};
  const int splits = cuda::AttentionPlan<T>(input, output, options).key_splits();
  if (splits_taken != nullptr) *splits_taken = splits;
  const std::size_t bytes = cuda::attend_workspace_size(input, output, options);
  cuda::DeviceBuffer<unsigned char> workspace(bytes);
  std::vector<T> update(dupdate.size());
  std::vector<float> lse(c.lse ? dlse.size() : 0), entropy(lse.size());
  for (int run = 0; run < (splits > 1 ? 2 : 1); ++run) {
    std::vector<T> previous = update;
    std::vector<float> previous_lse = lse, previous_entropy = entropy;
    cuda::attend_async(input, output, workspace.data(), bytes, stream, options);
    dupdate.copy_to_host(update.data(), update.size(), stream);
    if (c.lse) dlse.copy_to_host(lse.data(), lse.size(), stream);
    if (c.lse) dentropy.copy_to_host(entropy.data(), entropy.size(), stream);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    if (run > 0) {
      expect_same_bits(c.name, "update of a second split run", update, previous);
      expect_same_bits(c.name, "lse of a second split run", lse, previous_lse);
      expect_same_bits(c.name, "entropy of a second split run", entropy, previous_entropy);
    }
  }

  // The blocking form on the host arrays: the same kernels, so the same bits.
  std::vector<T> blocking_update(update.size(), poison<T>());
  std::vector<float> blocking_lse(lse.size(), std::nanf("")),
      blocking_entropy(lse.size(), std::nanf(""));
  attend(host.input,
         AttentionOutput<T>{blocking_update.data(), c.lse ? blocking_lse.data() : nullptr,
                            c.lse ? blocking_entropy.data() : nullptr},
         {Device::cuda, 0, precision});
  if (key_splits == 0) {
    expect_same_bits(c.name, "update", blocking_update, update);
    expect_same_bits(c.name, "lse", blocking_lse, lse);
    expect_same_bits(c.name, "entropy", blocking_entropy, entropy);
  }

  const Expected exact = dense_attention(c, in, false);
  const Expected naive = dense_attention(c, in, true);
  // The test's model of the dense form is emflow's own: the double reference of the same stored
  // values (its update rounded to T once: half a unit in the last place, |x| 2^-8 or 2^-11).
  std::vector<T> reference_update(update.size(), poison<T>());
  std::vector<float> reference_lse(lse.size(), std::nanf(""));
  attend(host.input,
         AttentionOutput<T>{reference_update.data(), c.lse ? reference_lse.data() : nullptr},
         {Device::reference});
  for (std::size_t i = 0; i < update.size(); ++i) {
    const double half_ulp = std::ldexp(std::abs(exact.update[i]), kHalfUlpExponent<T>) + 1e-6;
    ASSERT_LE(std::abs(as_float(reference_update[i]) - exact.update[i]), half_ulp)
        << c.name << ": the test's double model against Device::reference, update " << i;
  }
  for (std::size_t i = 0; i < lse.size(); ++i) {
    if (std::isinf(exact.lse[i])) {
      ASSERT_EQ(reference_lse[i], exact.lse[i]) << c.name << ": reference lse " << i;
    } else {
      ASSERT_NEAR(reference_lse[i], exact.lse[i], 1e-5) << c.name << ": reference lse " << i;
    }
  }
  std::vector<double> got, got_lse(lse.begin(), lse.end());
  for (const T& value : update) got.push_back(as_float(value));
  const auto [naive_error, naive_lse_error] = expect_accuracy_rule(
      c.name, {got, got_lse}, {exact.update, exact.lse}, {naive.update, naive.lse});
  double naive_entropy_error = 0.0;
  if (c.lse) {
    naive_entropy_error =
        expect_entropy_rule(c.name, std::vector<double>(entropy.begin(), entropy.end()),
                            exact.entropy, naive.entropy, exact.lse, c.tokens > 1);
  }
  if (key_splits != 0) {
    // Other splits than the automatic choice sum in another order: the two results agree within
    // the rule's bound.
    std::vector<double> blocking;
    for (const T& value : blocking_update) blocking.push_back(as_float(value));
    EXPECT_LE(max_difference(got, blocking), 2.0 * naive_error + 1e-6)
        << c.name << ": " << key_splits << " splits against the automatic choice";
    EXPECT_LE(
        max_difference(got_lse, std::vector<double>(blocking_lse.begin(), blocking_lse.end())),
        2.0 * naive_lse_error + 1e-6)
        << c.name << ": lse, " << key_splits << " splits against the automatic choice";
    EXPECT_LE(max_difference(std::vector<double>(entropy.begin(), entropy.end()),
                             std::vector<double>(blocking_entropy.begin(), blocking_entropy.end())),
              2.0 * naive_entropy_error + 1e-6)
        << c.name << ": entropy, " << key_splits << " splits against the automatic choice";
  }
  if constexpr (std::is_same_v<T, float>) {
    // The rule alone would also pass the float32 products: TF32 must show (its operands carry 10
    // mantissa bits, so the update differs from the fp32 path's somewhere).
    std::vector<float> fp32_update(update.size(), std::nanf(""));
    attend(host.input, AttentionOutput<float>{fp32_update.data()},
           {Device::cuda, 0, Precision::fp32});
    if (c.tokens > 1) {
      EXPECT_NE(max_difference(got, std::vector<double>(fp32_update.begin(), fp32_update.end())),
                0.0)
          << c.name << ": the TF32 update equals the float32 one";
    }
  }
}

class TcDense : public ::testing::TestWithParam<DenseCase> {};

TEST_P(TcDense, MatchesTheDoubleResultWithinTwiceTheNaiveError) {
  EMFLOW_REQUIRE_CUDA();
  const DenseCase& c = GetParam();
  with_storage_type(c.type, [&](auto stored_type) { check_case<decltype(stored_type)>(c); });
}

// name, type, batch, heads, tokens, cross queries, dim, mask, key lengths, bias, offset, lse
INSTANTIATE_TEST_SUITE_P(
    Cases, TcDense,
    ::testing::Values(
        DenseCase{"bf16_N1_d1_none", kBf16, 1, 1, 1, 0, 1, kNone, {}, true, true, true},
        DenseCase{"f16_N7_d5_causal_len", kF16, 2, 2, 7, 0, 5, kCausal, {7, 3}, true, false, true},
        DenseCase{"bf16_N33_d64_window5_len",
                  kBf16,
                  2,
                  1,
                  33,
                  0,
                  64,
                  kWindow5,
                  {33, 0},
                  false,
                  true,
                  true},
        DenseCase{"f16_N33_q5_d64_causal", kF16, 1, 2, 33, 5, 64, kCausal, {}, true, true, true},
        DenseCase{"bf16_N7_q33_d5_causal", kBf16, 1, 1, 7, 33, 5, kCausal, {}, false, true, true},
        DenseCase{
            "bf16_N130_d130_none_len", kBf16, 1, 1, 130, 0, 130, kNone, {97}, true, true, true},
        DenseCase{
            "f16_N130_d5_window37", kF16, 1, 2, 130, 0, 5, kWindow37, {}, false, false, false},
        DenseCase{"tf32_N1_d5_none", kTf32, 1, 1, 1, 0, 5, kNone, {}, true, true, true},
        DenseCase{
            "tf32_N33_d64_causal_len", kTf32, 2, 2, 33, 0, 64, kCausal, {33, 0}, true, true, true},
        DenseCase{"tf32_N7_q33_d5_window5", kTf32, 1, 1, 7, 33, 5, kWindow5, {}, false, true, true},
        DenseCase{
            "tf32_N130_d130_none_len", kTf32, 1, 1, 130, 0, 130, kNone, {97}, true, false, true},
        // Few queries against 600 keys: the automatic rule splits the keys in two (TcDenseSplits).
        DenseCase{"bf16_N600_q3_d64_causal_split",
                  kBf16,
                  1,
                  2,
                  600,
                  3,
                  64,
                  kCausal,
                  {},
                  true,
                  true,
                  true},
        DenseCase{"f16_N600_q17_d40_window37_split",
                  kF16,
                  2,
                  1,
                  600,
                  17,
                  40,
                  kWindow37,
                  {},
                  false,
                  true,
                  true},
        DenseCase{"tf32_N600_q2_d130_none_split",
                  kTf32,
                  1,
                  2,
                  600,
                  2,
                  130,
                  kNone,
                  {},
                  true,
                  false,
                  true}),
    [](const ::testing::TestParamInfo<DenseCase>& info) { return std::string(info.param.name); });

// Key splits on the tensor cores (flash-decoding, the float kernel's rule and merge): a few
// queries against many keys are split by the automatic rule (and then deterministic, checked in
// check_case), and asking for one split, or for others, gives a result within the rule's bound of
// the automatic one and of the double result.
TEST(TcDenseSplits, SplitAndUnsplitKeysAgreeWithinTheRule) {
  EMFLOW_REQUIRE_CUDA();
  const DenseCase bf16{
      "bf16_N600_q3_d64_causal", kBf16, 1, 2, 600, 3, 64, kCausal, {}, true, true, true};
  int splits = 0;
  check_case<bfloat16>(bf16, 0, &splits);
  EXPECT_EQ(splits, 2) << "the automatic rule splits 3 queries against 600 keys";
  check_case<bfloat16>(bf16, 1, &splits);
  EXPECT_EQ(splits, 1);
  check_case<bfloat16>(bf16, 5, &splits);
  EXPECT_EQ(splits, 5);
  // Self-attention is never split by the rule; asked for, its splits hold key lengths and the
  // window's rows that see no key of a split.
  const DenseCase tf32{"tf32_N130_d40_window37_len",
                       kTf32,
                       2,
                       2,
                       130,
                       0,
                       40,
                       kWindow37,
                       {130, 70},
                       true,
                       true,
                       true};
  check_case<float>(tf32, 0, &splits);
  EXPECT_EQ(splits, 1) << "self-attention is not split";
  check_case<float>(tf32, 3, &splits);
  EXPECT_EQ(splits, 3);
}

// What the tensor-core path does not compute or cannot run is refused by name, before any
// device work (these checks read no memory and run without a device).
TEST(TcDenseRefusals, UnsupportedOutputsAlgorithmsAndShapesAreNamed) {
  const DenseCase c{"refusal", kBf16, 1, 1, 3, 0, 4, kNone, {}, false, false, false};
  const Inputs in = make_inputs(c);
  const HostProblem<bfloat16> host(c, in);
  std::vector<bfloat16> update(12);
  std::vector<float> weights(9);
  const auto refusal = [&](const AttentionInput<bfloat16>& input,
                           const AttentionOutput<bfloat16>& output,
                           cuda::Algorithm algorithm = cuda::Algorithm::automatic) {
    std::string seen[2];
    for (int form = 0; form < 2; ++form) {
      try {
        if (form == 0) {
          cuda::attend_workspace_size(input, output, {algorithm});
        } else {
          unsigned char workspace[256];
          cuda::attend_async(input, output, workspace, sizeof workspace, nullptr, {algorithm});
        }
        seen[form] = "accepted";
      } catch (const Error& e) {
        // The message without the operation's name, which differs between the two.
        std::string what = e.what();
        what.erase(0, what.find(':'));
        seen[form] = std::string(to_string(e.code())) + what;
      }
    }
    EXPECT_EQ(seen[0], seen[1]) << "attend_workspace_size and attend_async differ";
    return seen[1];
  };
  const auto has = [](const std::string& message, const char* part) {
    return message.find(part) != std::string::npos;
  };
  // The reasons are route()'s (capability.hpp), the same for both calls.
  std::string m = refusal(host.input, {update.data(), nullptr, nullptr, weights.data()});
  EXPECT_TRUE(has(m, "unsupported") && has(m, "do not form the weights")) << m;
  m = refusal(host.input, {update.data()}, cuda::Algorithm::unfused);
  EXPECT_TRUE(has(m, "unsupported") && has(m, "unfused algorithm (cuBLAS)")) << m;
  AttentionInput<bfloat16> wide = host.input;
  wide.dim = 257;
  std::vector<bfloat16> big(257 * 257 * 3), big_update(257 * 3);
  wide.cloud = wide.layer.relevance = wide.layer.content = big.data();
  m = refusal(wide, {big_update.data()});
  EXPECT_TRUE(has(m, "unsupported") && has(m, "dim <= 256, got 257")) << m;
  AttentionInput<bfloat16> empty = host.input;
  empty.tokens = 0;
  m = refusal(empty, {update.data()});
  EXPECT_TRUE(has(m, "invalid_argument") && has(m, "'tokens'")) << m;
  // The size reads shapes only; the call refuses the missing operator by name.
  AttentionInput<bfloat16> no_content = host.input;
  no_content.layer.content = nullptr;
  EXPECT_EQ(cuda::attend_workspace_size(no_content, AttentionOutput<bfloat16>{update.data()}),
            cuda::attend_workspace_size(host.input, AttentionOutput<bfloat16>{update.data()}));
  unsigned char workspace[256];
  EXPECT_TRUE(throws_error(
      [&] {
        cuda::attend_async(no_content, AttentionOutput<bfloat16>{update.data()}, workspace,
                           sizeof workspace, nullptr);
      },
      ErrorCode::invalid_argument, {"'content'"}));
  // The blocking form refuses weights on device 'cuda'; Device::automatic computes them on the
  // CPU, as the tensor-core path does not form them.
  try {
    attend(host.input, AttentionOutput<bfloat16>{update.data(), nullptr, nullptr, weights.data()},
           {Device::cuda});
    ADD_FAILURE() << "weights on device 'cuda' were accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::unsupported) << e.what();
  }
  std::fill(weights.begin(), weights.end(), std::nanf(""));
  attend(host.input, AttentionOutput<bfloat16>{update.data(), nullptr, nullptr, weights.data()},
         {Device::automatic});
  for (float w : weights) EXPECT_TRUE(std::isfinite(w) && w >= 0.f && w <= 1.f) << "weight " << w;
}

// TF32 is a permission (docs/MATH.md §7.2): where the tensor-core path does not compute what is
// asked (weights here, or Algorithm::unfused), float input runs the float32 products, so the result
// is the fp32 one to the bit; double and 16-bit input refuse tf32 by name.
TEST(TcDenseRefusals, Tf32FallsBackToFloat32ProductsWhereTheTensorCoresDoNotApply) {
  EMFLOW_REQUIRE_CUDA();
  const DenseCase c{"permission", kTf32, 1, 2, 9, 0, 6, kCausal, {}, true, true, true};
  const Inputs in = make_inputs(c);
  const HostProblem<float> host(c, in);
  const std::size_t rows = 2 * 9;
  std::vector<float> tf32_update(9 * 6, std::nanf("")), tf32_weights(rows * 9, std::nanf(""));
  std::vector<float> fp32_update(tf32_update.size()), fp32_weights(tf32_weights.size());
  attend(host.input,
         AttentionOutput<float>{tf32_update.data(), nullptr, nullptr, tf32_weights.data()},
         {Device::cuda, 0, Precision::tf32});
  attend(host.input,
         AttentionOutput<float>{fp32_update.data(), nullptr, nullptr, fp32_weights.data()},
         {Device::cuda, 0, Precision::fp32});
  expect_same_bits("permission", "update", tf32_update, fp32_update);
  expect_same_bits("permission", "weights", tf32_weights, fp32_weights);
  double largest = 0.0;
  for (float w : tf32_weights) largest = std::max(largest, static_cast<double>(w));
  EXPECT_GT(largest, 0.1) << "the weights must not vanish";

  std::vector<double> x(in.x.values.begin(), in.x.values.end()),
      m(in.m.values.begin(), in.m.values.end()), f(in.f.values.begin(), in.f.values.end()),
      update(9 * 6);
  AttentionInput<double> wide;
  wide.cloud = x.data();
  wide.tokens = 9;
  wide.dim = 6;
  wide.layer = {2, m.data(), f.data()};
  try {
    attend(wide, AttentionOutput<double>{update.data()}, {Device::cuda, 0, Precision::tf32});
    ADD_FAILURE() << "tf32 accepted for double input";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << e.what();
    EXPECT_NE(std::string(e.what()).find("'precision'"), std::string::npos) << e.what();
  }
}

// The workspace is checked on the device: too small and misaligned are named.
TEST(TcDenseRefusals, WorkspaceTooSmallOrMisalignedIsNamed) {
  EMFLOW_REQUIRE_CUDA();
  const DenseCase c{"workspace", kF16, 1, 1, 3, 0, 4, kNone, {}, false, false, false};
  const Inputs in = make_inputs(c);
  const HostProblem<float16> host(c, in);
  cuda::DeviceBuffer<float16> dx(12), dm(16), df(16), dupdate(12);
  OwnedStream owned;
  ASSERT_EQ(cudaStreamCreateWithFlags(&owned.stream, cudaStreamNonBlocking), cudaSuccess);
  dx.copy_from_host(host.x.data(), 12, owned.stream);
  dm.copy_from_host(host.m.data(), 16, owned.stream);
  df.copy_from_host(host.f.data(), 16, owned.stream);
  AttentionInput<float16> input = host.input;
  input.cloud = dx.data();
  input.layer.relevance = dm.data();
  input.layer.content = df.data();
  const AttentionOutput<float16> output{dupdate.data()};
  const std::size_t bytes = cuda::attend_workspace_size(input, output);
  ASSERT_GT(bytes, 0u);
  cuda::DeviceBuffer<unsigned char> workspace(bytes + 256);
  const auto message = [&](void* at, std::size_t size) {
    try {
      cuda::attend_async(input, output, at, size, owned.stream);
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << e.what();
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_NE(message(workspace.data(), bytes - 1).find("'workspace_bytes'"), std::string::npos);
  EXPECT_NE(message(workspace.data() + 1, bytes).find("aligned"), std::string::npos);
  // The host's cloud is refused by name on the device path.
  input.cloud = host.x.data();
  EXPECT_NE(message(workspace.data(), bytes).find("'cloud'"), std::string::npos);
  ASSERT_EQ(cudaStreamSynchronize(owned.stream), cudaSuccess);
}

}  // namespace
}  // namespace emflow::testing
#endif
