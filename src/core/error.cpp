#include "emflow/error.hpp"

namespace emflow {

const char* to_string(ErrorCode code) noexcept {
  switch (code) {
    case ErrorCode::invalid_argument:
      return "invalid_argument";
    case ErrorCode::io:
      return "io";
    case ErrorCode::unsupported:
      return "unsupported";
    case ErrorCode::device:
      return "device";
    case ErrorCode::out_of_memory:
      return "out_of_memory";
    case ErrorCode::internal:
      return "internal";
  }
  return "unknown";
}

}  // namespace emflow
