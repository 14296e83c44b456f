// Values in a storage type and back, for tests that build their inputs in double: stored<T>
// rounds once to nearest even (through float for the 16-bit types, as emflow's own narrowing
// does), value_of<T> reads a stored value exactly.
#pragma once

#include <type_traits>
#include <vector>

#include "emflow/attention.hpp"
#include "emflow/precision.hpp"

namespace emflow::testing {

/// `value` stored in T.
template <class T>
T stored(double value) {
  if constexpr (std::is_same_v<T, bfloat16>) {
    return to_bfloat16(static_cast<float>(value));
  } else if constexpr (std::is_same_v<T, float16>) {
    return to_float16(static_cast<float>(value));
  } else {
    return static_cast<T>(value);
  }
}

/// Every value of `values` stored in T.
template <class T>
std::vector<T> stored(const std::vector<double>& values) {
  std::vector<T> out;
  out.reserve(values.size());
  for (double v : values) out.push_back(stored<T>(v));
  return out;
}

/// The value a stored T holds, exactly.
template <class T>
double value_of(T v) {
  if constexpr (is_16bit_v<T>) {
    return static_cast<double>(to_float(v));
  } else {
    return static_cast<double>(v);
  }
}

/// Every stored value of `values`, exactly.
template <class T>
std::vector<double> values_of(const std::vector<T>& values) {
  std::vector<double> out;
  out.reserve(values.size());
  for (const T& v : values) out.push_back(value_of(v));
  return out;
}

}  // namespace emflow::testing
