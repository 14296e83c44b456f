// emflow: the one error type every public call throws.
#pragma once

#include <stdexcept>
#include <string>

namespace emflow {

/// What kind of failure an emflow::Error reports.
enum class ErrorCode {
  invalid_argument,  ///< a shape, size, pointer or value the call cannot accept
  io,                ///< a file could not be read or written, or is malformed
  unsupported,       ///< valid input that this build or backend cannot handle (e.g. no CUDA)
  device,            ///< a CUDA or cuBLAS call failed
  out_of_memory,     ///< host or device allocation failed
  internal,          ///< a broken invariant inside emflow (a bug: please report it)
};

/// Returns a stable lower-case name for `code` ("invalid_argument", "io", ...).
const char* to_string(ErrorCode code) noexcept;

/// Every failure in emflow is reported by throwing this type. The message names the operation,
/// the argument, and the expected and actual value, e.g.
/// `attend: argument 'relevance' has shape (2, 64, 64), expected (2, 32, 32)`.
class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message) : std::runtime_error(message), code_(code) {}
  ErrorCode code() const noexcept { return code_; }

 private:
  ErrorCode code_;
};

}  // namespace emflow
