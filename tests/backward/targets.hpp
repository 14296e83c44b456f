// The host targets of the backward tests, and what the SDPA and layer tests share: each test is
// written once and run on every target, each held against the double reference
// (src/reference/backward.cpp).
//
//   reference_f64, reference_f32   Device::reference (double arithmetic, rounded to T once)
//   cpu_f32_t1, _t2, _t3           Device::cpu in float at 1, 2 and 3 threads (the fused kernels)
//   cpu_f64                        Device::cpu in double (the reference)
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <ostream>
#include <string>
#include <vector>

#include "common/testing.hpp"
#include "emflow/attention.hpp"
#include "emflow/reference.hpp"

namespace emflow::testing {

struct HostTarget {
  Device device;
  bool is_double;
  int threads = 0;

  std::string name() const {
    std::string n = device == Device::reference ? "reference" : "cpu";
    n += is_double ? "_f64" : "_f32";
    if (device == Device::cpu && !is_double) n += "_t" + std::to_string(threads);
    return n;
  }
  /// The accuracy contract against the double reference (see the tests' headers).
  double tolerance() const { return is_double ? 1e-12 : 1e-5; }
};

inline const std::vector<HostTarget>& host_targets() {
  static const std::vector<HostTarget> targets = {
      {Device::reference, true, 1}, {Device::reference, false, 1}, {Device::cpu, false, 1},
      {Device::cpu, false, 2},      {Device::cpu, false, 3},       {Device::cpu, true, 2},
  };
  return targets;
}

/// Which upstream gradients a backward call is given (docs/MATH.md §8: each may be absent).
enum class Through { update, lse, entropy, all };

inline const char* to_string(Through t) {
  switch (t) {
    case Through::update:
      return "update";
    case Through::lse:
      return "lse";
    case Through::entropy:
      return "entropy";
    case Through::all:
      return "all";
  }
  return "?";
}

inline constexpr Through kEveryThrough[] = {Through::update, Through::lse, Through::entropy,
                                            Through::all};

inline bool with_update(Through t) { return t == Through::update || t == Through::all; }
inline bool with_lse(Through t) { return t == Through::lse || t == Through::all; }
inline bool with_entropy(Through t) { return t == Through::entropy || t == Through::all; }

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

/// `values` rounded to float and back: inputs that float and double targets hold exactly alike.
inline Tensor<double> float_exact(Tensor<double> t) {
  for (double& v : t.values()) v = static_cast<double>(static_cast<float>(v));
  return t;
}

/// `t` with NaN on the rows (of `width` elements) for which `keep` is false.
inline Tensor<double> nan_rows(Tensor<double> t, std::int64_t width,
                               const std::vector<bool>& keep) {
  for (std::size_t row = 0; row < keep.size(); ++row) {
    if (keep[row]) continue;
    for (std::int64_t a = 0; a < width; ++a) t[static_cast<std::int64_t>(row) * width + a] = kNaN;
  }
  return t;
}

/// For each row of a (B, H, Nq) statistic, whether its query sees a key (lse != -inf).
inline std::vector<bool> rows_with_keys(const Tensor<double>& lse) {
  std::vector<bool> sees(static_cast<std::size_t>(lse.size()));
  for (std::int64_t e = 0; e < lse.size(); ++e) {
    sees[static_cast<std::size_t>(e)] = lse[e] != -std::numeric_limits<double>::infinity();
  }
  return sees;
}

template <class T>
std::vector<T> as_vector(const Tensor<double>& t) {
  return std::vector<T>(t.values().begin(), t.values().end());
}

template <class T>
std::vector<T> poisoned(std::int64_t count) {
  return std::vector<T>(static_cast<std::size_t>(count), std::numeric_limits<T>::quiet_NaN());
}

/// Succeeds when the rows of `values` (of `width` elements) for which `zero` is true are exactly 0;
/// names the first that is not.
template <class T>
::testing::AssertionResult zero_rows(const std::vector<T>& values, std::int64_t width,
                                     const std::vector<bool>& zero) {
  for (std::size_t row = 0; row < zero.size(); ++row) {
    if (!zero[row]) continue;
    for (std::int64_t a = 0; a < width; ++a) {
      const T v = values[row * static_cast<std::size_t>(width) + static_cast<std::size_t>(a)];
      if (!(v == T(0))) {
        return ::testing::AssertionFailure()
               << "row " << row << " element " << a << " is " << v << ", expected exactly 0";
      }
    }
  }
  return ::testing::AssertionSuccess();
}

/// |actual - expected| <= tolerance * magnitude for a scalar gradient, with the magnitude given
/// by the caller (the size of the terms it sums, so that cancellation does not tighten it).
inline ::testing::AssertionResult scalar_close(double actual, double expected, double magnitude,
                                               double tolerance) {
  if (std::abs(actual - expected) <= tolerance * magnitude) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << actual << " vs " << expected << ": error " << std::abs(actual - expected) << " > "
         << tolerance << " * " << magnitude;
}

inline double norm(const Tensor<double>& t) {
  double s = 0.0;
  for (double v : t.values()) s += v * v;
  return std::sqrt(s);
}

}  // namespace emflow::testing
