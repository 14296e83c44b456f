// The 16-bit storage conversions of precision.hpp against the compiler's own binary16 type and
// against rounding done in double, over every 16-bit pattern and over ties and edges.
#include "emflow/precision.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>

#include "emflow/error.hpp"

namespace emflow {
namespace {

TEST(Precision, EveryFloat16PatternConvertsExactlyAndBack) {
  for (std::uint32_t bits = 0; bits < 65536; ++bits) {
    _Float16 native;
    const std::uint16_t pattern = static_cast<std::uint16_t>(bits);
    std::memcpy(&native, &pattern, sizeof native);
    const float value = to_float(float16{pattern});
    if (std::isnan(static_cast<float>(native))) {
      EXPECT_TRUE(std::isnan(value)) << bits;
      EXPECT_TRUE(std::isnan(to_float(to_float16(value)))) << bits;
      continue;
    }
    ASSERT_EQ(value, static_cast<float>(native)) << bits;
    ASSERT_EQ(std::signbit(value), std::signbit(static_cast<float>(native))) << bits;
    ASSERT_EQ(to_float16(value).bits, pattern) << bits;
  }
}

TEST(Precision, Float16RoundingMatchesTheCompilerOnRandomAndEdgeFloats) {
  std::mt19937 random(7);
  std::uniform_int_distribution<std::uint32_t> any;
  auto check = [](float value) {
    const _Float16 native = static_cast<_Float16>(value);
    std::uint16_t expected;
    std::memcpy(&expected, &native, sizeof expected);
    if (std::isnan(value)) {
      EXPECT_TRUE(std::isnan(to_float(to_float16(value))));
    } else {
      ASSERT_EQ(to_float16(value).bits, expected) << std::hexfloat << value;
    }
  };
  for (int k = 0; k < 2000000; ++k) check(detail::bits_float(any(random)));
  // Ties between neighbours (normal and subnormal), the overflow edge and the underflow edge.
  for (std::uint32_t bits = 0; bits < 0x7c00; bits += 7) {
    const float low = to_float(float16{static_cast<std::uint16_t>(bits)});
    const float high = to_float(float16{static_cast<std::uint16_t>(bits + 1)});
    check(static_cast<float>((static_cast<double>(low) + high) / 2));
    check(-static_cast<float>((static_cast<double>(low) + high) / 2));
  }
  for (float v : {65504.0f, 65519.996f, 65520.0f, 1e30f, 5.9604645e-8f, 2.9802322e-8f,
                  2.9802326e-8f, 1e-45f, std::numeric_limits<float>::infinity()}) {
    check(v);
    check(-v);
  }
}

TEST(Precision, Bfloat16IsTheUpperHalfRoundedToNearestEven) {
  for (std::uint32_t bits = 0; bits < 65536; ++bits) {
    const float value = to_float(bfloat16{static_cast<std::uint16_t>(bits)});
    if (std::isnan(value)) continue;
    ASSERT_EQ(to_bfloat16(value).bits, bits) << bits;
  }
  std::mt19937 random(11);
  std::uniform_int_distribution<std::uint32_t> any;
  for (int k = 0; k < 2000000; ++k) {
    const float value = detail::bits_float(any(random));
    const float rounded = to_float(to_bfloat16(value));
    if (std::isnan(value)) {
      ASSERT_TRUE(std::isnan(rounded));
      continue;
    }
    // The nearest bfloat16 by exact arithmetic in double: truncate, then compare distances;
    // the step past the largest finite value is 2^128, which rounds to infinity.
    const std::uint32_t truncated = detail::float_bits(value) & 0xffff0000u;
    const double down = detail::bits_float(truncated);
    const double step = std::ldexp(1.0, std::max(std::ilogb(down == 0 ? 1e-38 : down), -126) - 7);
    const double up = down + std::copysign(step, down == 0 ? value : down);
    const double to_down = std::fabs(static_cast<double>(value) - down);
    const double to_up = std::fabs(up - value);
    const bool down_even = (truncated & 0x10000u) == 0;
    const double nearest = to_down < to_up || (to_down == to_up && down_even) ? down : up;
    const float expected = std::fabs(nearest) >= 0x1p128 ? std::copysign(INFINITY, value)
                                                         : static_cast<float>(nearest);
    ASSERT_EQ(detail::float_bits(rounded), detail::float_bits(expected)) << std::hexfloat << value;
  }
}

TEST(Precision, Tf32KeepsTenMantissaBitsRoundingHalfAway) {
  EXPECT_EQ(round_to_tf32(1.0f), 1.0f);
  EXPECT_EQ(round_to_tf32(1.0f + 0x1p-11f), 1.0f + 0x1p-10f);  // the tie goes away from zero
  EXPECT_EQ(round_to_tf32(-(1.0f + 0x1p-11f)), -(1.0f + 0x1p-10f));
  EXPECT_EQ(round_to_tf32(1.0f + 0x1p-12f), 1.0f);
  EXPECT_EQ(round_to_tf32(std::numeric_limits<float>::infinity()),
            std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(round_to_tf32(std::numeric_limits<float>::quiet_NaN())));
  std::mt19937 random(3);
  std::uniform_real_distribution<float> unit(-4.0f, 4.0f);
  for (int k = 0; k < 100000; ++k) {
    const float value = unit(random);
    const float rounded = round_to_tf32(value);
    EXPECT_EQ(detail::float_bits(rounded) & 0x1fffu, 0u);
    EXPECT_LE(std::fabs(rounded - value), std::ldexp(std::fabs(value), -11));
  }
}

TEST(Precision, NamesRoundTripAndAnUnknownNameIsRefusedNamingTheArgument) {
  for (Precision p : {Precision::fp32, Precision::tf32, Precision::bf16, Precision::fp16}) {
    EXPECT_EQ(parse_precision(to_string(p)), p);
  }
  try {
    parse_precision("fp8", "--precision");
    FAIL() << "fp8 was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("--precision"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("fp8"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace emflow
