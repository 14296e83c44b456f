// Private helpers for emflow's one error path: build a message that names the operation, the
// argument, the expectation and the actual value, and throw emflow::Error.
#pragma once

#include <cstdint>
#include <sstream>
#include <string>
#include <utility>

#include "emflow/error.hpp"
#include "emflow/types.hpp"

namespace emflow::detail {

template <class... Parts>
std::string concat(Parts&&... parts) {
  std::ostringstream out;
  // A stream swallows a failed allocation and returns a truncated text; rethrow it instead.
  out.exceptions(std::ios::badbit);
  (out << ... << std::forward<Parts>(parts));
  return out.str();
}

template <class... Parts>
[[noreturn]] void fail(ErrorCode code, Parts&&... parts) {
  throw Error(code, concat(std::forward<Parts>(parts)...));
}

/// "op: argument 'name' <what>"
template <class... Parts>
[[noreturn]] void fail_argument(const char* operation, const char* argument, Parts&&... parts) {
  fail(ErrorCode::invalid_argument, operation, ": argument '", argument, "' ",
       std::forward<Parts>(parts)...);
}

inline void expect_positive(const char* operation, const char* argument, std::int64_t value) {
  if (value < 1) fail_argument(operation, argument, "must be >= 1, got ", value);
}

inline void expect_not_null(const char* operation, const char* argument, const void* pointer) {
  if (pointer == nullptr) fail_argument(operation, argument, "must not be null");
}

/// a * b, or an invalid_argument error naming `argument` if it overflows int64.
std::int64_t checked_multiply(const char* operation, const char* argument, std::int64_t a,
                              std::int64_t b);

/// Product of `shape`, naming `argument` on overflow.
std::int64_t checked_product(const char* operation, const char* argument, const Shape& shape);

}  // namespace emflow::detail
