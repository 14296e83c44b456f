// Shared test helpers: seeded random problems and tensors, relative errors as assertions, NaN
// poisoning, error expectations, scratch folders, test names and device skips.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "emflow/attention.hpp"
#include "emflow/capability.hpp"
#include "emflow/error.hpp"
#include "emflow/tensor.hpp"

namespace emflow::testing {

/// Deterministic values in [lo, hi) from `seed`.
std::vector<double> uniform(std::size_t count, std::uint64_t seed, double lo = -1.0,
                            double hi = 1.0);

/// A tensor of `shape` filled by uniform(): the same values as a Problem's arrays would hold.
Tensor<double> random_tensor(const Shape& shape, std::uint64_t seed, double lo = -1.0,
                             double hi = 1.0);

/// The host's fast device: Device::cpu, or Device::reference where none of the CPU engine's
/// paths runs (a processor without AVX2, or EMFLOW_CPU_DISABLE naming avx2).
inline Device host_device() {
  return this_machine().cpu_missing.empty() ? Device::cpu : Device::reference;
}

/// The two precisions every backend computes in, for typed tests.
using FloatTypes = ::testing::Types<float, double>;

/// Runs `body(T{})` with T double when `is_double`, else float: one test body written once as a
/// generic lambda, `[&](auto zero) { check<decltype(zero)>(...); }`, for both precisions.
template <class Body>
void in_precision(bool is_double, Body&& body) {
  if (is_double) {
    body(double{});
  } else {
    body(float{});
  }
}

/// A complete seeded attention problem, stored in double so it can be converted exactly to
/// float (values are rounded to float first, so float and double problems are identical).
struct Problem {
  std::int64_t batch = 1, tokens = 1, dim = 1, heads = 1;
  double beta = 1.0;
  Mask mask;
  bool key_bias = false, offset = false;
  std::vector<std::int64_t> key_lengths;  // empty: none
  std::vector<double> cloud, relevance, content, bias, shift;

  /// Random problem; operator entries scaled by `scale` / sqrt(dim) so softmax is not flat.
  static Problem random(std::int64_t batch, std::int64_t tokens, std::int64_t dim,
                        std::int64_t heads, std::uint64_t seed, double scale = 2.0);
};

/// Host arrays of type T for a Problem, plus outputs poisoned with NaN.
template <class T>
struct Buffers {
  std::vector<T> cloud, relevance, content, bias, shift;
  std::vector<T> update, lse, entropy, weights;
  std::vector<std::int64_t> key_lengths;  // a copy, so a Buffers outlives its Problem
  AttentionInput<T> input;
  AttentionOutput<T> output;

  explicit Buffers(const Problem& p, bool with_weights = false, bool with_stats = true);
  void poison();
};

/// ||a - b|| / ||b|| in double (0 when both are zero). Entries where both are -inf count as
/// equal; any NaN in `a` makes the result NaN.
template <class A, class B>
double relative_error(const std::vector<A>& a, const std::vector<B>& b);

/// Largest |a_i - b_i| treating equal infinities as equal; NaN if any NaN.
template <class A, class B>
double max_abs_difference(const std::vector<A>& a, const std::vector<B>& b);

/// Succeeds when relative_error(actual, expected) < tolerance. On failure says the error, the
/// first index whose difference is out of line (NaN where the other is not, a different
/// infinity, or |a - b| > tolerance * max(|b|, rms(b))) and both values there.
template <class A, class B>
::testing::AssertionResult close_to(const std::vector<A>& actual, const std::vector<B>& expected,
                                    double tolerance);

/// Fails the current test (returns false) if any entry is NaN; names the first index.
template <class T>
::testing::AssertionResult all_finite_or_neg_inf(const std::vector<T>& values);

/// Runs `call` and succeeds when it throws emflow::Error with `code` and a message holding every
/// string of `fragments`; otherwise says what happened instead.
template <class Call>
::testing::AssertionResult throws_error(Call&& call, ErrorCode code,
                                        const std::vector<std::string>& fragments = {}) {
  try {
    call();
  } catch (const Error& e) {
    const std::string message = e.what();
    if (e.code() != code) {
      return ::testing::AssertionFailure() << "code " << to_string(e.code()) << ", expected "
                                           << to_string(code) << ": " << message;
    }
    for (const std::string& fragment : fragments) {
      if (message.find(fragment) == std::string::npos) {
        return ::testing::AssertionFailure() << "message lacks \"" << fragment << "\": " << message;
      }
    }
    return ::testing::AssertionSuccess() << message;
  }
  return ::testing::AssertionFailure()
         << "no emflow::Error thrown (expected " << to_string(code) << ")";
}

/// A fixture owning a fresh folder under the system's temporary directory, named after the
/// process and the test, removed with everything in it after the test.
class ScratchFolder : public ::testing::Test {
 protected:
  explicit ScratchFolder(std::string prefix) : prefix_(std::move(prefix)) {}
  void SetUp() override;
  void TearDown() override;
  std::filesystem::path folder_;

 private:
  std::string prefix_;
};

/// `text` as a gtest parameter name: letters, digits and '_' only ("window:5" -> "window5").
std::string name_part(const std::string& text);

/// "B2_H3_N33_d7_causal": the shape and mask part of an attention test case's name.
std::string shape_name(std::int64_t batch, std::int64_t heads, std::int64_t tokens,
                       std::int64_t dim, const Mask& mask);

/// True when a CUDA device is usable; otherwise records a clear skip reason.
bool cuda_available(std::string* reason);

}  // namespace emflow::testing

/// Use at the top of a GPU test: skips with the reason when no device is present.
#define EMFLOW_REQUIRE_CUDA()                                    \
  do {                                                           \
    std::string emflow_skip_reason;                              \
    if (!::emflow::testing::cuda_available(&emflow_skip_reason)) \
      GTEST_SKIP() << "no CUDA device: " << emflow_skip_reason;  \
  } while (0)
