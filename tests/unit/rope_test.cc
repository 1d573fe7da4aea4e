// Device::RopeShift of the device under test (tests/testing/test_device.h: HostDevice, or
// CudaDevice with KVMESH_TEST_DEVICE=cuda) against the float64 reference of docs/api.md#rope-shift.
// Rows go in by Scatter and come back by Gather (arena memory may be on the GPU).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "cache/device/device.h"
#include "cache/dtype.h"
#include "gtest/gtest.h"
#include "tests/testing/pattern.h"
#include "tests/testing/test_device.h"
#include "tests/unit/rope_reference.h"

namespace kvmesh {
namespace {

using testutil::DecodeElement;
using testutil::MakeTestDevice;
using testutil::ReferenceRopeShift;

// Rounding bound of one float32 computation stored back in `dtype`: half an ulp of the result
// relative to it, plus float32 slack for the angle.
double OneRoundingTolerance(DType dtype, double expected) {
  const double u = dtype == DType::kF32   ? std::ldexp(1.0, -23)
                   : dtype == DType::kF16 ? std::ldexp(1.0, -11)
                                          : std::ldexp(1.0, -8);
  return u * std::fabs(expected) + 5e-5;
}

std::vector<uint8_t> EncodeF32(const std::vector<float>& v) {
  std::vector<uint8_t> bytes(4 * v.size());
  std::memcpy(bytes.data(), v.data(), bytes.size());
  return bytes;
}

// Rotates one row of F32 values on the device under test and returns the result.
std::vector<float> ShiftF32(const RopeSpec& rope, int heads, int head_dim, int delta,
                            const std::vector<float>& row) {
  std::unique_ptr<Device> device = MakeTestDevice(1 << 20);
  absl::StatusOr<DeviceArena> arena = device->Allocate(row.size() * 4);
  EXPECT_TRUE(arena.ok());
  const std::vector<Plane> planes = {Plane{0, row.size() * 4}};
  const std::vector<int32_t> rows = {0};
  const std::vector<uint8_t> src = EncodeF32(row);
  EXPECT_TRUE(device->Scatter(*arena, planes, rows, src.data()).ok());
  RopeShiftParams params;
  params.rope = rope;
  params.dtype = DType::kF32;
  params.num_heads = heads;
  params.head_dim = head_dim;
  params.delta = delta;
  EXPECT_TRUE(device->RopeShift(*arena, planes, rows, params).ok());
  std::vector<float> out(row.size());
  EXPECT_TRUE(device->Gather(*arena, planes, rows, reinterpret_cast<uint8_t*>(out.data())).ok());
  return out;
}

RopeSpec MakeRope(RopeType type, int dims, float base = 10000.0f, float freq_scale = 1.0f) {
  RopeSpec r;
  r.type = type;
  r.dims = dims;
  r.base = base;
  r.freq_scale = freq_scale;
  return r;
}

TEST(RopeShiftTest, NormalRotatesAdjacentPairsCounterclockwise) {
  const std::vector<float> out = ShiftF32(MakeRope(RopeType::kNormal, 4), 1, 4, 1, {1, 1, 0, 1});
  // Pair (0,1) by 1 rad; pair (2,3) by 1 * 10000^(-2/4) = 0.01 rad.
  EXPECT_NEAR(out[0], std::cos(1.0) - std::sin(1.0), 1e-6);
  EXPECT_NEAR(out[1], std::sin(1.0) + std::cos(1.0), 1e-6);
  EXPECT_NEAR(out[2], -std::sin(0.01), 1e-6);
  EXPECT_NEAR(out[3], std::cos(0.01), 1e-6);
}

TEST(RopeShiftTest, NeoxRotatesHalves) {
  const std::vector<float> out = ShiftF32(MakeRope(RopeType::kNeox, 4), 1, 4, 1, {1, 1, 0, 1});
  // Pair (0,2) by 1 rad; pair (1,3) by 0.01 rad.
  EXPECT_NEAR(out[0], std::cos(1.0), 1e-6);
  EXPECT_NEAR(out[2], std::sin(1.0), 1e-6);
  EXPECT_NEAR(out[1], std::cos(0.01) - std::sin(0.01), 1e-6);
  EXPECT_NEAR(out[3], std::sin(0.01) + std::cos(0.01), 1e-6);
}

TEST(RopeShiftTest, NegativeDeltaAndFreqScaleAndTailUnchanged) {
  // head_dim 6, dims 2: only elements 0,1 of each head turn; freq_scale 0.5, delta -3.
  const std::vector<float> in = {1, 2, 3, 4, 5, 6, -1, -2, -3, -4, -5, -6};
  const std::vector<float> out =
      ShiftF32(MakeRope(RopeType::kNormal, 2, 500.0f, 0.5f), 2, 6, -3, in);
  const double t = -1.5;
  EXPECT_NEAR(out[0], 1 * std::cos(t) - 2 * std::sin(t), 1e-5);
  EXPECT_NEAR(out[1], 1 * std::sin(t) + 2 * std::cos(t), 1e-5);
  EXPECT_NEAR(out[6], -1 * std::cos(t) + 2 * std::sin(t), 1e-5);
  EXPECT_NEAR(out[7], -1 * std::sin(t) - 2 * std::cos(t), 1e-5);
  for (int i : {2, 3, 4, 5, 8, 9, 10, 11}) EXPECT_EQ(out[i], in[i]) << i;
}

TEST(RopeShiftTest, ShiftAndBackRestoresF32) {
  const RopeSpec rope = MakeRope(RopeType::kNeox, 8);
  std::vector<float> in(16);
  for (int i = 0; i < 16; ++i) in[i] = 0.25f * (i - 7);
  const std::vector<float> there = ShiftF32(rope, 2, 8, 37, in);
  const std::vector<float> back = ShiftF32(rope, 2, 8, -37, there);
  for (int i = 0; i < 16; ++i) EXPECT_NEAR(back[i], in[i], 1e-5) << i;
}

using RopeCase = std::tuple<RopeType, DType, int /*dims*/, int /*delta*/>;

class RopeShiftMatchesReference : public ::testing::TestWithParam<RopeCase> {};

TEST_P(RopeShiftMatchesReference, OnPatternRows) {
  const auto [type, dtype, dims, delta] = GetParam();
  constexpr int kHeads = 3;
  constexpr int kHeadDim = 16;
  constexpr int kRows = 6;
  const size_t row_elems = kHeads * kHeadDim;
  const size_t esize = DTypeSize(dtype);
  const size_t row_bytes = row_elems * esize;
  const RopeSpec rope = MakeRope(type, dims, 1000.0f, 0.75f);

  std::unique_ptr<Device> device = MakeTestDevice(1 << 20);
  // Two planes (two layers) with a gap between them.
  const std::vector<Plane> planes = {Plane{0, row_bytes}, Plane{kRows * row_bytes + 64, row_bytes}};
  absl::StatusOr<DeviceArena> arena = device->Allocate(2 * kRows * row_bytes + 64);
  ASSERT_TRUE(arena.ok());
  std::vector<uint8_t> init(2 * kRows * row_bytes);
  testutil::FillPattern(dtype, 7, init.size() / esize, init.data());
  const std::vector<int32_t> all_rows = {0, 1, 2, 3, 4, 5};
  ASSERT_TRUE(device->Scatter(*arena, planes, all_rows, init.data()).ok());

  const std::vector<int32_t> shifted = {4, 1};
  RopeShiftParams params;
  params.rope = rope;
  params.dtype = dtype;
  params.num_heads = kHeads;
  params.head_dim = kHeadDim;
  params.delta = delta;
  ASSERT_TRUE(device->RopeShift(*arena, planes, shifted, params).ok());

  std::vector<uint8_t> out(init.size());
  ASSERT_TRUE(device->Gather(*arena, planes, all_rows, out.data()).ok());
  for (int plane = 0; plane < 2; ++plane) {
    for (int r = 0; r < kRows; ++r) {
      const size_t off = (plane * kRows + r) * row_bytes;
      const bool is_shifted = r == 1 || r == 4;
      if (!is_shifted) {
        EXPECT_EQ(std::memcmp(out.data() + off, init.data() + off, row_bytes), 0)
            << "plane " << plane << " row " << r << " changed";
        continue;
      }
      std::vector<double> expected(row_elems);
      for (size_t i = 0; i < row_elems; ++i) {
        expected[i] = DecodeElement(dtype, init.data() + off + i * esize);
      }
      ReferenceRopeShift(rope, kHeads, kHeadDim, delta, &expected);
      for (size_t i = 0; i < row_elems; ++i) {
        const size_t e = off + i * esize;
        if (static_cast<int>(i % kHeadDim) >= dims) {
          EXPECT_EQ(std::memcmp(out.data() + e, init.data() + e, esize), 0)
              << "element past dims changed: plane " << plane << " row " << r << " i " << i;
          continue;
        }
        const double got = DecodeElement(dtype, out.data() + e);
        EXPECT_NEAR(got, expected[i], OneRoundingTolerance(dtype, expected[i]))
            << "plane " << plane << " row " << r << " element " << i;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    AllTypes, RopeShiftMatchesReference,
    ::testing::Combine(::testing::Values(RopeType::kNormal, RopeType::kNeox),
                       ::testing::Values(DType::kF32, DType::kF16, DType::kBF16),
                       ::testing::Values(16, 6), ::testing::Values(-1, -7, 5, -100)),
    [](const ::testing::TestParamInfo<RopeCase>& info) {
      const RopeType type = std::get<0>(info.param);
      const DType dtype = std::get<1>(info.param);
      const int dims = std::get<2>(info.param);
      const int delta = std::get<3>(info.param);
      std::string name = type == RopeType::kNormal ? "Normal" : "Neox";
      name += dtype == DType::kF32 ? "F32" : dtype == DType::kF16 ? "F16" : "BF16";
      name += "Dims" + std::to_string(dims);
      name += delta < 0 ? "Minus" + std::to_string(-delta) : "Plus" + std::to_string(delta);
      return name;
    });

TEST(RopeShiftTest, ZeroDeltaIsExact) {
  for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
    std::unique_ptr<Device> device = MakeTestDevice(1 << 20);
    const size_t row_bytes = 8 * DTypeSize(dtype);
    absl::StatusOr<DeviceArena> arena = device->Allocate(row_bytes);
    ASSERT_TRUE(arena.ok());
    std::vector<uint8_t> init(row_bytes);
    testutil::FillPattern(dtype, 3, 8, init.data());
    const std::vector<Plane> planes = {Plane{0, row_bytes}};
    const std::vector<int32_t> rows = {0};
    ASSERT_TRUE(device->Scatter(*arena, planes, rows, init.data()).ok());
    RopeShiftParams params;
    params.rope = MakeRope(RopeType::kNormal, 8);
    params.dtype = dtype;
    params.num_heads = 1;
    params.head_dim = 8;
    params.delta = 0;
    ASSERT_TRUE(device->RopeShift(*arena, planes, rows, params).ok());
    EXPECT_EQ(testutil::ArenaBytes(*device, *arena), init);
  }
}

}  // namespace
}  // namespace kvmesh
