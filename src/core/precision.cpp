#include "emflow/precision.hpp"

#include "core/check.hpp"

namespace emflow {

const char* to_string(Precision precision) noexcept {
  switch (precision) {
    case Precision::fp32:
      return "fp32";
    case Precision::tf32:
      return "tf32";
    case Precision::bf16:
      return "bf16";
    case Precision::fp16:
      return "fp16";
  }
  return "unknown";
}

Precision parse_precision(const std::string& text, const char* argument) {
  for (Precision p : {Precision::fp32, Precision::tf32, Precision::bf16, Precision::fp16}) {
    if (text == to_string(p)) return p;
  }
  detail::fail(ErrorCode::invalid_argument, "argument '", argument,
               "' must be one of fp32, tf32, bf16, fp16, got '", text, "'");
}

}  // namespace emflow
