// emflow: non-finite input (NaN, +-Inf).
//
// Policy (docs/RELIABILITY.md §5, the rule in docs/MATH.md §6.6): emflow computes on whatever
// numbers it is given, never turns a non-finite input into an error by itself, and never turns
// one into a plausible number; a NaN or Inf spreads exactly as far as the mathematics carries it:
//   * a cloud token x_j that is not finite makes non-finite only the outputs of the queries that
//     can see key j (under the mask and the key lengths) and the outputs of query j itself;
//     every other query's update, lse, entropy and weights are what they would be without it;
//   * a non-finite entry of an operator (M_h, F_h, u_h) or of the offset c may reach every
//     query that sees a key (typically NaN); padding queries always get 0, -inf and 0;
//   * what a reached query gets is NaN, not "no key": a NaN or +inf among its visible scores (or
//     only -inf ones) makes that head's lse, entropy and weights and the query's update NaN; a
//     non-finite content F_h x_j makes the update non-finite for every query that sees key j.
// The CUDA device keeps this promise except for one case: a non-finite visible token hidden from
// some real queries by a causal or window mask may still reach them there (as 0 * NaN).
// Callers who want a clean refusal instead check their arrays up front with find_non_finite
// (the CLI's --check-finite does this for every float input).
#pragma once

#include <cstdint>
#include <string>

#include "emflow/tensor.hpp"
#include "emflow/types.hpp"

namespace emflow {

/// Index of the first element of data[0, count) that is NaN or +-Inf, or -1 when all are
/// finite (and for count <= 0).
template <class T>
std::int64_t find_non_finite(const T* data, std::int64_t count) noexcept;

/// The row-major multi-index of flat element `index` of an array of `shape`, written as
/// "[i0, i1, ...]" (e.g. "[0, 5, 2]"). Throws emflow::Error (invalid_argument) when `index` is
/// outside the array.
std::string multi_index(const Shape& shape, std::int64_t index);

/// Throws emflow::Error (invalid_argument) when `array` holds a NaN or an infinity, naming
/// `what` (e.g. "--x 'cloud.npy'"), the first offending element as a multi-index and its value:
/// "--x 'cloud.npy': element [0, 5, 2] is nan; ...". Used by the CLI's --check-finite.
template <class T>
void require_finite(const Tensor<T>& array, const std::string& what);

extern template std::int64_t find_non_finite<float>(const float*, std::int64_t) noexcept;
extern template std::int64_t find_non_finite<double>(const double*, std::int64_t) noexcept;
extern template void require_finite<float>(const Tensor<float>&, const std::string&);
extern template void require_finite<double>(const Tensor<double>&, const std::string&);

}  // namespace emflow
