#include "emflow/types.hpp"

#include <cerrno>
#include <cstdlib>

#include "check.hpp"

namespace emflow {

Mask parse_mask(const std::string& original, const char* argument) {
  // Surrounding whitespace is dropped (a value pasted with a trailing space still parses); any
  // whitespace inside the value is refused below, W included.
  constexpr const char* kSpace = " \t\n\v\f\r";
  const std::size_t first = original.find_first_not_of(kSpace);
  const std::string text =
      first == std::string::npos
          ? std::string()
          : original.substr(first, original.find_last_not_of(kSpace) - first + 1);
  if (text == "none") return Mask::none();
  if (text == "causal") return Mask::causal();
  const std::string prefix = "window:";
  if (text.compare(0, prefix.size(), prefix) == 0) {
    const std::string width = text.substr(prefix.size());
    // Digits only: strtoll alone would also take a leading space or sign.
    const bool digits =
        !width.empty() && width.find_first_not_of("0123456789") == std::string::npos;
    char* end = nullptr;
    errno = 0;
    const long long w = digits ? std::strtoll(width.c_str(), &end, 10) : 0;
    if (!digits || errno == ERANGE || w < 1) {
      detail::fail_argument("parse_mask", argument,
                            "expects window:W with an integer W >= 1, got '", original, "'");
    }
    return Mask::sliding_window(w);
  }
  detail::fail_argument("parse_mask", argument, "expects none, causal or window:W, got '", original,
                        "'");
}

std::string to_string(const Mask& mask) {
  switch (mask.kind) {
    case MaskKind::causal:
      return "causal";
    case MaskKind::window:
      return "window:" + std::to_string(mask.window);
    case MaskKind::none:
    default:
      return "none";
  }
}

Device parse_device(const std::string& text, const char* argument) {
  if (text == "auto") return Device::automatic;
  if (text == "cpu") return Device::cpu;
  if (text == "cuda") return Device::cuda;
  if (text == "reference") return Device::reference;
  detail::fail_argument("parse_device", argument, "expects auto, cpu, cuda or reference, got '",
                        text, "'");
}

const char* to_string(Device device) noexcept {
  switch (device) {
    case Device::automatic:
      return "auto";
    case Device::cpu:
      return "cpu";
    case Device::cuda:
      return "cuda";
    case Device::reference:
      return "reference";
  }
  return "unknown";
}

const char* to_string(Dtype dtype) noexcept {
  switch (dtype) {
    case Dtype::float32:
      return "float32";
    case Dtype::float64:
      return "float64";
    case Dtype::int64:
      return "int64";
    case Dtype::int32:
      return "int32";
    case Dtype::float16:
      return "float16";
    case Dtype::bfloat16:
      return "bfloat16";
    case Dtype::boolean:
      return "bool";
    case Dtype::uint8:
      return "uint8";
    case Dtype::int8:
      return "int8";
    case Dtype::int16:
      return "int16";
    case Dtype::uint16:
      return "uint16";
    case Dtype::uint32:
      return "uint32";
    case Dtype::uint64:
      return "uint64";
    case Dtype::float8_e4m3:
      return "float8_e4m3";
    case Dtype::float8_e5m2:
      return "float8_e5m2";
  }
  return "unknown";
}

std::int64_t item_size(Dtype dtype) noexcept {
  switch (dtype) {
    case Dtype::float64:
    case Dtype::int64:
    case Dtype::uint64:
      return 8;
    case Dtype::float32:
    case Dtype::int32:
    case Dtype::uint32:
      return 4;
    case Dtype::float16:
    case Dtype::bfloat16:
    case Dtype::int16:
    case Dtype::uint16:
      return 2;
    case Dtype::boolean:
    case Dtype::uint8:
    case Dtype::int8:
    case Dtype::float8_e4m3:
    case Dtype::float8_e5m2:
      return 1;
  }
  return 0;
}

std::string to_string(const Shape& shape) {
  std::string out = "(";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(shape[i]);
  }
  if (shape.size() == 1) out += ",";
  return out + ")";
}

namespace detail {

std::int64_t checked_multiply(const char* operation, const char* argument, std::int64_t a,
                              std::int64_t b) {
  std::int64_t product = 0;
  if (__builtin_mul_overflow(a, b, &product)) {
    fail_argument(operation, argument, "has a size product that overflows 64 bits (", a, " x ", b,
                  ")");
  }
  return product;
}

std::int64_t checked_product(const char* operation, const char* argument, const Shape& shape) {
  std::int64_t n = 1;
  for (std::int64_t e : shape) {
    if (e < 0) fail_argument(operation, argument, "has a negative extent in ", to_string(shape));
    n = checked_multiply(operation, argument, n, e);
  }
  return n;
}

}  // namespace detail
}  // namespace emflow
