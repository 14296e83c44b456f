// emflow: 16-bit storage types and the precisions a computation can run in (docs/MATH.md §7).
//
// bfloat16 and float16 are storage formats: 16-bit patterns with exact conversions to float and
// round-to-nearest-even conversions from float, written once here and used by the host code, the
// CUDA kernels and the CPU emulation of CUDA alike. Arithmetic is never done in 16 bits:
// products accumulate in float32 and the statistics (lse, entropy, weights) are float32.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "emflow/types.hpp"

namespace emflow {

/// bfloat16: 1 sign, 8 exponent, 7 mantissa bits (the upper half of a float32).
struct bfloat16 {
  std::uint16_t bits = 0;
};

/// IEEE 754 binary16: 1 sign, 5 exponent, 10 mantissa bits; largest finite 65504.
struct float16 {
  std::uint16_t bits = 0;
};

/// How the products of an operation are computed.
enum class Precision {
  fp32,  ///< float32 storage and products
  tf32,  ///< float32 storage; the operands of the products rounded to TF32 (10 mantissa bits)
  bf16,  ///< bfloat16 storage; float32 accumulation
  fp16,  ///< float16 storage; float32 accumulation
};

/// The precision a storage type computes in by default: bf16 for bfloat16, fp16 for float16,
/// fp32 for float and double.
template <class T>
constexpr Precision storage_precision() noexcept {
  if constexpr (std::is_same_v<T, bfloat16>) {
    return Precision::bf16;
  } else if constexpr (std::is_same_v<T, float16>) {
    return Precision::fp16;
  } else {
    return Precision::fp32;
  }
}

/// "fp32", "tf32", "bf16" or "fp16".
const char* to_string(Precision precision) noexcept;

/// The inverse of to_string(); throws emflow::Error (invalid_argument) naming `argument` and the
/// accepted names for anything else.
Precision parse_precision(const std::string& text, const char* argument = "precision");

namespace detail {

EMFLOW_HOST_DEVICE inline std::uint32_t float_bits(float value) noexcept {
  std::uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}

EMFLOW_HOST_DEVICE inline float bits_float(std::uint32_t bits) noexcept {
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

}  // namespace detail

/// Exact.
EMFLOW_HOST_DEVICE inline float to_float(bfloat16 value) noexcept {
  return detail::bits_float(static_cast<std::uint32_t>(value.bits) << 16);
}

/// Round to nearest, ties to even; overflow gives infinity; a NaN stays a (quiet) NaN of the
/// same sign.
EMFLOW_HOST_DEVICE inline bfloat16 to_bfloat16(float value) noexcept {
  const std::uint32_t bits = detail::float_bits(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    return {static_cast<std::uint16_t>((bits >> 16) | 0x0040u)};
  }
  const std::uint32_t rounded = bits + 0x7fffu + ((bits >> 16) & 1u);
  return {static_cast<std::uint16_t>(rounded >> 16)};
}

/// Exact (subnormals included).
EMFLOW_HOST_DEVICE inline float to_float(float16 value) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(value.bits & 0x8000u) << 16;
  const std::uint32_t exponent = (value.bits >> 10) & 0x1fu;
  const std::uint32_t mantissa = value.bits & 0x3ffu;
  if (exponent == 0x1fu) {  // infinity or NaN
    return detail::bits_float(sign | 0x7f800000u | (mantissa << 13) | (mantissa ? 0x400000u : 0u));
  }
  if (exponent != 0) {
    return detail::bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  }
  // Zero or subnormal: mantissa * 2^-24, exact in float.
  const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
  return detail::bits_float(sign | detail::float_bits(magnitude));
}

/// Round to nearest, ties to even (subnormal results included); beyond 65504 rounds to infinity
/// as IEEE 754 does (from 65520 up); a NaN stays a (quiet) NaN of the same sign.
EMFLOW_HOST_DEVICE inline float16 to_float16(float value) noexcept {
  const std::uint32_t bits = detail::float_bits(value);
  const std::uint16_t sign = static_cast<std::uint16_t>((bits >> 16) & 0x8000u);
  const std::uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return {static_cast<std::uint16_t>(sign | 0x7e00u)};
  if (magnitude >= 0x477ff000u) return {static_cast<std::uint16_t>(sign | 0x7c00u)};  // >= 65520
  const std::uint32_t exponent = magnitude >> 23;
  if (exponent >= 113) {  // normal in binary16: drop 13 mantissa bits, ties to even
    const std::uint32_t rebased = magnitude - (112u << 23);
    const std::uint32_t rounded = rebased + 0xfffu + ((rebased >> 13) & 1u);
    return {static_cast<std::uint16_t>(sign | (rounded >> 13))};
  }
  if (exponent < 102) return {sign};  // below half the smallest subnormal (2^-25): zero
  // Subnormal result: the value in units of 2^-24, ties to even. The implicit bit joins the
  // mantissa and shifts right by 126 - exponent (14 to 24 places).
  const std::uint32_t full = (magnitude & 0x7fffffu) | 0x800000u;
  const std::uint32_t shift = 126u - exponent;
  const std::uint32_t kept = full >> shift;
  const std::uint32_t rest = full & ((1u << shift) - 1u);
  const std::uint32_t half = 1u << (shift - 1);
  const std::uint32_t rounded = kept + ((rest > half || (rest == half && (kept & 1u))) ? 1u : 0u);
  return {static_cast<std::uint16_t>(sign | rounded)};
}

/// The float32 value rounded to TF32 (10 mantissa bits, 8 exponent bits) by round to nearest,
/// ties away from zero, as cvt.rna.tf32.f32 does; infinities and NaN pass unchanged.
EMFLOW_HOST_DEVICE inline float round_to_tf32(float value) noexcept {
  const std::uint32_t bits = detail::float_bits(value);
  if ((bits & 0x7f800000u) == 0x7f800000u) return value;
  return detail::bits_float((bits + 0x1000u) & 0xffffe000u);
}

}  // namespace emflow
