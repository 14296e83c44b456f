// The accuracy contracts of every backend against the double reference of the stored (rounded)
// inputs (docs/MATH.md §6, §7), written once: a relative error of 1e-12 for double and 1e-5 for
// float, and for the 16-bit storage types and TF32 products the rule that the max error is at
// most twice the error of a naive kernel in the same precision, output by output. Where the naive
// error is exactly 0 (one key, padding rows) the rule allows a floor of 2^-20 (1 + the largest
// reference magnitude of that output) instead, the float32 rounding of a result that is exact in
// double.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

namespace emflow::testing {

/// max |a - b|; equal infinities count 0, a NaN on one side only counts infinity.
inline double max_error(const std::vector<double>& a, const std::vector<double>& b) {
  double worst = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (a[i] == b[i] || (std::isnan(a[i]) && std::isnan(b[i]))) continue;
    const double e = std::abs(a[i] - b[i]);
    worst = std::max(worst, std::isnan(e) ? std::numeric_limits<double>::infinity() : e);
  }
  return worst;
}

/// The largest finite |a_i|.
inline double max_magnitude(const std::vector<double>& a) {
  double m = 0.0;
  for (double v : a) {
    if (std::isfinite(v)) m = std::max(m, std::abs(v));
  }
  return m;
}

/// The 2x-naive rule for one output: an empty string when max_error(ours, exact) is within twice
/// max_error(naive, exact) (or the floor), else what failed, naming `name`.
inline std::string check_rule(const char* name, const std::vector<double>& ours,
                              const std::vector<double>& naive, const std::vector<double>& exact) {
  const double ours_error = max_error(ours, exact), naive_error = max_error(naive, exact);
  const double bound =
      naive_error > 0.0 ? 2.0 * naive_error : std::ldexp(1.0 + max_magnitude(exact), -20);
  if (ours_error <= bound) return {};
  return std::string(name) + ": error " + std::to_string(ours_error) + " > bound " +
         std::to_string(bound) + " (naive " + std::to_string(naive_error) + ")";
}

/// The relative-error contract of a float32 (1e-5) or float64 (1e-12) computation.
inline double relative_tolerance(bool is_double) { return is_double ? 1e-12 : 1e-5; }

}  // namespace emflow::testing
