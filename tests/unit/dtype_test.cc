// Host conversions between float and F16/BF16, checked exhaustively against references written
// here from the IEEE definitions (round to nearest, ties to even).
#include "cache/dtype.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <set>
#include <string>

#include "gtest/gtest.h"
#include "tests/testing/pattern.h"

namespace kvmesh {
namespace {

float FromBits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint32_t ToBits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return bits;
}

double DecodeHalf(uint16_t h) {
  uint8_t bytes[2];
  std::memcpy(bytes, &h, 2);
  return testutil::DecodeElement(DType::kF16, bytes);
}

// Rounds a finite float to the nearest value with `mantissa_bits` explicit bits and a minimum
// normal exponent `min_exp` (subnormals below it), ties to even; returns +-inf above `max_value`.
double ReferenceRound(float x, int mantissa_bits, int min_exp, double max_value) {
  const double v = x;
  if (v == 0) return v;
  int exp;
  std::frexp(v, &exp);  // v = m * 2^exp, 0.5 <= |m| < 1, so the leading bit is 2^(exp-1)
  const int lead = std::max(exp - 1, min_exp);
  const double quantum = std::ldexp(1.0, lead - mantissa_bits);
  const double rounded = std::nearbyint(v / quantum) * quantum;  // default mode: ties to even
  if (std::fabs(rounded) > max_value) return std::copysign(HUGE_VAL, v);
  return rounded;
}

constexpr double kHalfMax = 65504.0;
const double kBFloatMax = std::ldexp(255.0, 127 - 7);  // 0x7F7F

TEST(HalfTest, DecodesEveryBitPatternExactly) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const double expected = DecodeHalf(static_cast<uint16_t>(h));
    const float got = HalfToFloat(static_cast<uint16_t>(h));
    if (std::isnan(expected)) {
      ASSERT_TRUE(std::isnan(got)) << std::hex << h;
    } else {
      ASSERT_EQ(static_cast<double>(got), expected) << std::hex << h;
      ASSERT_EQ(std::signbit(got), (h & 0x8000) != 0) << std::hex << h;
    }
  }
}

TEST(HalfTest, RoundTripsEveryBitPattern) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const uint16_t half = static_cast<uint16_t>(h);
    const uint16_t back = FloatToHalf(HalfToFloat(half));
    if ((h & 0x7C00) == 0x7C00 && (h & 0x3FF) != 0) {
      EXPECT_EQ(back & 0x7C00, 0x7C00) << std::hex << h;
      EXPECT_NE(back & 0x3FF, 0) << "NaN became infinity: " << std::hex << h;
    } else {
      ASSERT_EQ(back, half) << std::hex << h;
    }
  }
}

TEST(HalfTest, KnownValues) {
  EXPECT_EQ(FloatToHalf(0.0f), 0x0000);
  EXPECT_EQ(FloatToHalf(-0.0f), 0x8000);
  EXPECT_EQ(FloatToHalf(1.0f), 0x3C00);
  EXPECT_EQ(FloatToHalf(-2.0f), 0xC000);
  EXPECT_EQ(FloatToHalf(0.5f), 0x3800);
  EXPECT_EQ(FloatToHalf(65504.0f), 0x7BFF);
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -14)), 0x0400);  // smallest normal
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(FloatToHalf(std::numeric_limits<float>::infinity()), 0x7C00);
  EXPECT_EQ(FloatToHalf(-std::numeric_limits<float>::infinity()), 0xFC00);
  EXPECT_EQ(HalfToFloat(0x3555), 0.333251953125f);
}

TEST(HalfTest, RoundsToNearestEven) {
  // Ties between 1 and 1 + 2^-10 go to the even mantissa.
  EXPECT_EQ(FloatToHalf(1.0f + std::ldexp(1.0f, -11)), 0x3C00);
  EXPECT_EQ(FloatToHalf(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3C02);
  // Just above a tie rounds up, just below rounds down.
  EXPECT_EQ(FloatToHalf(1.0f + std::ldexp(1.0f, -11) + std::ldexp(1.0f, -20)), 0x3C01);
  EXPECT_EQ(FloatToHalf(1.0f + std::ldexp(1.0f, -11) - std::ldexp(1.0f, -20)), 0x3C00);
  // Subnormal ties: 0.5 and 1.5 quanta.
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -25)), 0x0000);
  EXPECT_EQ(FloatToHalf(3 * std::ldexp(1.0f, -25)), 0x0002);
  EXPECT_EQ(FloatToHalf(-3 * std::ldexp(1.0f, -25)), 0x8002);
  // Rounding up across the exponent boundary and into infinity.
  EXPECT_EQ(FloatToHalf(2.0f - std::ldexp(1.0f, -12)), 0x4000);
  EXPECT_EQ(FloatToHalf(65519.0f), 0x7BFF);
  EXPECT_EQ(FloatToHalf(65520.0f), 0x7C00);
  EXPECT_EQ(FloatToHalf(-1e6f), 0xFC00);
  // Far below the smallest subnormal: signed zero.
  EXPECT_EQ(FloatToHalf(1e-10f), 0x0000);
  EXPECT_EQ(FloatToHalf(-1e-10f), 0x8000);
}

TEST(HalfTest, NaNStaysNaN) {
  for (uint32_t bits : {0x7FC00000u, 0xFFC00000u, 0x7F800001u, 0x7FA00000u, 0x7F801000u}) {
    const uint16_t h = FloatToHalf(FromBits(bits));
    EXPECT_EQ(h & 0x7C00, 0x7C00) << std::hex << bits;
    EXPECT_NE(h & 0x03FF, 0) << "NaN " << std::hex << bits << " became infinity";
    EXPECT_TRUE(std::isnan(HalfToFloat(h)));
  }
}

TEST(HalfTest, MatchesReferenceRoundingOnSampledFloats) {
  // Every 251st bit pattern (odd stride: hits all mantissa residues) of all finite floats.
  for (uint64_t b = 0; b < 0x100000000ull; b += 251) {
    const float x = FromBits(static_cast<uint32_t>(b));
    if (!std::isfinite(x)) continue;
    const double expected = ReferenceRound(x, 10, -14, kHalfMax);
    const double got = DecodeHalf(FloatToHalf(x));
    ASSERT_EQ(got, expected) << "float bits 0x" << std::hex << b;
    ASSERT_EQ(std::signbit(got), std::signbit(x)) << "float bits 0x" << std::hex << b;
  }
}

TEST(BFloat16Test, RoundTripsEveryBitPattern) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const uint16_t b = static_cast<uint16_t>(h);
    const float f = BFloat16ToFloat(b);
    ASSERT_EQ(ToBits(f), h << 16);
    const uint16_t back = FloatToBFloat16(f);
    if ((h & 0x7F80) == 0x7F80 && (h & 0x7F) != 0) {
      EXPECT_TRUE(std::isnan(BFloat16ToFloat(back))) << std::hex << h;
    } else {
      ASSERT_EQ(back, b) << std::hex << h;
    }
  }
}

TEST(BFloat16Test, KnownValuesAndRounding) {
  EXPECT_EQ(FloatToBFloat16(1.0f), 0x3F80);
  EXPECT_EQ(FloatToBFloat16(-2.0f), 0xC000);
  EXPECT_EQ(FloatToBFloat16(-0.0f), 0x8000);
  EXPECT_EQ(FloatToBFloat16(1.0f + std::ldexp(1.0f, -8)), 0x3F80);      // tie to even
  EXPECT_EQ(FloatToBFloat16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3F82);  // tie to even
  EXPECT_EQ(FloatToBFloat16(1.0f + std::ldexp(1.0f, -8) + std::ldexp(1.0f, -20)), 0x3F81);
  EXPECT_EQ(FloatToBFloat16(std::numeric_limits<float>::max()), 0x7F80);  // rounds to inf
  EXPECT_EQ(FloatToBFloat16(std::numeric_limits<float>::infinity()), 0x7F80);
  EXPECT_EQ(FloatToBFloat16(-std::numeric_limits<float>::infinity()), 0xFF80);
  EXPECT_EQ(FloatToBFloat16(FromBits(0x7F7F7FFF)), 0x7F7F);  // largest finite, rounded down
}

TEST(BFloat16Test, NaNStaysQuietNaN) {
  for (uint32_t bits : {0x7FC00000u, 0xFFC00000u, 0x7F800001u, 0x7FFFFFFFu, 0xFF800001u}) {
    const uint16_t b = FloatToBFloat16(FromBits(bits));
    EXPECT_EQ(b & 0x7F80, 0x7F80) << std::hex << bits;
    EXPECT_NE(b & 0x0040, 0) << "not quiet: " << std::hex << bits << " -> " << b;
    EXPECT_TRUE(std::isnan(BFloat16ToFloat(b)));
  }
}

TEST(BFloat16Test, MatchesReferenceRoundingOnSampledFloats) {
  for (uint64_t b = 0; b < 0x100000000ull; b += 251) {
    const float x = FromBits(static_cast<uint32_t>(b));
    if (!std::isfinite(x)) continue;
    const double expected = ReferenceRound(x, 7, -126, kBFloatMax);
    const double got = BFloat16ToFloat(FloatToBFloat16(x));
    ASSERT_EQ(got, expected) << "float bits 0x" << std::hex << b;
    ASSERT_EQ(std::signbit(got), std::signbit(x)) << "float bits 0x" << std::hex << b;
  }
}

TEST(DTypeTest, SizesAndNames) {
  EXPECT_EQ(DTypeSize(DType::kF32), 4u);
  EXPECT_EQ(DTypeSize(DType::kF16), 2u);
  EXPECT_EQ(DTypeSize(DType::kBF16), 2u);
  std::set<std::string> names;
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
    const std::string name(DTypeName(t));
    EXPECT_FALSE(name.empty());
    names.insert(name);
  }
  EXPECT_EQ(names.size(), 3u);
}

TEST(DTypeTest, LoadAndStoreElementUseTheDtypeEncoding) {
  uint8_t buf[12] = {};
  StoreElement(DType::kF32, buf, 1, -1.5f);
  EXPECT_EQ(LoadElement(DType::kF32, buf, 1), -1.5f);
  uint32_t f32;
  std::memcpy(&f32, buf + 4, 4);
  EXPECT_EQ(f32, 0xBFC00000u);
  StoreElement(DType::kF16, buf, 3, 1.0f);
  uint16_t h;
  std::memcpy(&h, buf + 6, 2);
  EXPECT_EQ(h, 0x3C00);
  EXPECT_EQ(LoadElement(DType::kF16, buf, 3), 1.0f);
  StoreElement(DType::kBF16, buf, 5, -2.0f);
  std::memcpy(&h, buf + 10, 2);
  EXPECT_EQ(h, 0xC000);
  EXPECT_EQ(LoadElement(DType::kBF16, buf, 5), -2.0f);
}

TEST(DTypeTest, PatternValuesAreExactAndNonZero) {
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
    uint8_t buf[4 * 64];
    testutil::FillPattern(t, 42, 64, buf);
    for (size_t i = 0; i < 64; ++i) {
      const double v = testutil::DecodeElement(t, buf + i * DTypeSize(t));
      EXPECT_GE(std::fabs(v), 1.0 / 16) << i;
      EXPECT_LT(std::fabs(v), 2.0) << i;
      EXPECT_EQ(static_cast<double>(LoadElement(t, buf, i)), v) << i;
    }
  }
}

}  // namespace
}  // namespace kvmesh
