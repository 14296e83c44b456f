// The error helpers of emflow::distributed: emflow::Error with a message that names the
// operation, the argument, the expected and the actual value, as the library's own are written.
// Over the public error type only, so that the distributed library builds against an installed
// emflow (tests/consumer/distributed).
#pragma once

#include <cstdint>
#include <sstream>
#include <string>
#include <utility>

#include "emflow/error.hpp"

namespace emflow::distributed::detail {

/// Throws emflow::Error(code) whose message is `parts` streamed one after the other.
template <class... Parts>
[[noreturn]] void fail(ErrorCode code, Parts&&... parts) {
  std::ostringstream message;
  message.exceptions(std::ios::badbit);  // a failed allocation is rethrown, not a cut message
  (message << ... << std::forward<Parts>(parts));
  throw Error(code, message.str());
}

/// "operation: argument 'name' <parts>", ErrorCode::invalid_argument.
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

}  // namespace emflow::distributed::detail
