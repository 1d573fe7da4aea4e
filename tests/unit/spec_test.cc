// ValidateSpec, the derived geometry (the seed's capacity rule) and payload arithmetic.
#include "cache/spec.h"

#include <climits>
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/unit/cache_test_util.h"

namespace kvmesh {
namespace {

using ::testing::HasSubstr;
using testutil::Chunked;
using testutil::Full;
using testutil::Group;
using testutil::RecurrentGroup;
using testutil::Rope;
using testutil::RotatingGroup;
using testutil::Sliding;
using testutil::Spec;

CacheSpec ValidSpec() {
  return Spec(DType::kF16, 4, 64, 8,
              {Group(Full(), 2, 2, 8, 8, Rope(RopeType::kNormal, 8)),
               Group(Sliding(16, 0), 1, 1, 4, 4, Rope(RopeType::kNeox, 4)), Group(Chunked(8))});
}

TEST(ValidateSpecTest, AcceptsValidSpecs) {
  EXPECT_TRUE(ValidateSpec(ValidSpec()).ok()) << ValidateSpec(ValidSpec());
  // Edges that are still valid.
  CacheSpec s = ValidSpec();
  s.groups[1].attention.window = Sliding(16, 16);  // memory == window
  EXPECT_TRUE(ValidateSpec(s).ok()) << ValidateSpec(s);
  s.groups[0].attention.rope.dims = s.groups[0].attention.head_dim_k;  // dims == head_dim_k
  EXPECT_TRUE(ValidateSpec(s).ok()) << ValidateSpec(s);
  s.groups[2].attention.rope = RopeSpec{};  // NONE with dims 0
  EXPECT_TRUE(ValidateSpec(s).ok()) << ValidateSpec(s);
  s.name = std::string(kMaxNameLength, 'n');
  EXPECT_TRUE(ValidateSpec(s).ok()) << ValidateSpec(s);
  s.groups.assign(kMaxGroups, Group(Full()));
  EXPECT_TRUE(ValidateSpec(s).ok()) << ValidateSpec(s);
}

struct BadSpecCase {
  std::string label;
  std::string field;  // the message names it
  std::function<void(CacheSpec&)> mutate;
};

class ValidateSpecRejects : public ::testing::TestWithParam<BadSpecCase> {};

TEST_P(ValidateSpecRejects, WithInvalidArgumentNamingTheField) {
  CacheSpec spec = ValidSpec();
  GetParam().mutate(spec);
  const absl::Status status = ValidateSpec(spec);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr(GetParam().field));
}

std::vector<BadSpecCase> BadSpecs() {
  std::vector<BadSpecCase> cases = {
      {"EmptyName", "name", [](CacheSpec& s) { s.name = ""; }},
      {"LongName", "name", [](CacheSpec& s) { s.name = std::string(kMaxNameLength + 1, 'n'); }},
      {"ZeroMaxSequences", "max_sequences", [](CacheSpec& s) { s.max_sequences = 0; }},
      {"NegativeMaxSequences", "max_sequences", [](CacheSpec& s) { s.max_sequences = -1; }},
      {"ZeroCapacity", "capacity", [](CacheSpec& s) { s.capacity = 0; }},
      {"NegativeCapacity", "capacity", [](CacheSpec& s) { s.capacity = -5; }},
      {"ZeroMaxBatch", "max_batch", [](CacheSpec& s) { s.max_batch = 0; }},
      {"NegativeMaxBatch", "max_batch", [](CacheSpec& s) { s.max_batch = -1; }},
      {"NoGroups", "groups", [](CacheSpec& s) { s.groups.clear(); }},
      {"TooManyGroups", "groups",
       [](CacheSpec& s) { s.groups.assign(kMaxGroups + 1, Group(Full())); }},
      {"ZeroLayers", "num_layers", [](CacheSpec& s) { s.groups[1].num_layers = 0; }},
      {"NegativeLayers", "num_layers", [](CacheSpec& s) { s.groups[0].num_layers = -2; }},
      {"TooManyLayers", "num_layers",
       [](CacheSpec& s) { s.groups[2].num_layers = kMaxLayersPerGroup + 1; }},
      {"ZeroHeads", "num_kv_heads", [](CacheSpec& s) { s.groups[0].attention.num_kv_heads = 0; }},
      {"NegativeHeads", "num_kv_heads",
       [](CacheSpec& s) { s.groups[1].attention.num_kv_heads = -1; }},
      {"TooManyHeads", "num_kv_heads",
       [](CacheSpec& s) { s.groups[2].attention.num_kv_heads = kMaxHeads + 1; }},
      {"ZeroHeadDimK", "head_dim_k", [](CacheSpec& s) { s.groups[2].attention.head_dim_k = 0; }},
      {"NegativeHeadDimK", "head_dim_k",
       [](CacheSpec& s) { s.groups[2].attention.head_dim_k = -4; }},
      {"TooBigHeadDimK", "head_dim_k",
       [](CacheSpec& s) { s.groups[2].attention.head_dim_k = kMaxHeadDim + 1; }},
      {"ZeroHeadDimV", "head_dim_v", [](CacheSpec& s) { s.groups[0].attention.head_dim_v = 0; }},
      {"NegativeHeadDimV", "head_dim_v",
       [](CacheSpec& s) { s.groups[0].attention.head_dim_v = -8; }},
      {"TooBigHeadDimV", "head_dim_v",
       [](CacheSpec& s) { s.groups[0].attention.head_dim_v = kMaxHeadDim + 1; }},
      {"ZeroWindow", "window", [](CacheSpec& s) { s.groups[1].attention.window = Sliding(0); }},
      {"NegativeWindow", "window",
       [](CacheSpec& s) { s.groups[1].attention.window = Sliding(-3); }},
      {"NegativeMemory", "memory",
       [](CacheSpec& s) { s.groups[1].attention.window = Sliding(16, -1); }},
      {"MemoryBelowWindow", "memory",
       [](CacheSpec& s) { s.groups[1].attention.window = Sliding(16, 15); }},
      {"ZeroChunk", "chunk", [](CacheSpec& s) { s.groups[2].attention.window = Chunked(0); }},
      {"NegativeChunk", "chunk", [](CacheSpec& s) { s.groups[2].attention.window = Chunked(-8); }},
      {"OddRopeDimsNormal", "dims", [](CacheSpec& s) { s.groups[0].attention.rope.dims = 7; }},
      {"OddRopeDimsNeox", "dims", [](CacheSpec& s) { s.groups[1].attention.rope.dims = 3; }},
      {"RopeDimsAboveHeadDim", "dims", [](CacheSpec& s) { s.groups[0].attention.rope.dims = 10; }},
      {"NegativeRopeDims", "dims", [](CacheSpec& s) { s.groups[0].attention.rope.dims = -2; }},
      // A rope that rotates nothing is a malformed spec (interpretation: dims is "> 0, even").
      {"ZeroRopeDims", "dims", [](CacheSpec& s) { s.groups[1].attention.rope.dims = 0; }},
      {"ZeroRopeBase", "base", [](CacheSpec& s) { s.groups[0].attention.rope.base = 0.0f; }},
      {"NegativeRopeBase", "base", [](CacheSpec& s) { s.groups[1].attention.rope.base = -1.0f; }},
      {"ZeroFreqScale", "freq_scale",
       [](CacheSpec& s) { s.groups[0].attention.rope.freq_scale = 0.0f; }},
      {"NaNRopeBase", "base",
       [](CacheSpec& s) { s.groups[0].attention.rope.base = std::nanf(""); }},
      {"NameWithSlash", "name", [](CacheSpec& s) { s.name = "a/b"; }},
      {"TooManySequences", "max_sequences",
       [](CacheSpec& s) {
         s.max_sequences = kMaxSequences + 1;
         s.capacity = 1;
         s.groups = {Group(Full())};
       }},
      // Derived sizes beyond the limits that keep them representable.
      {"FullCellsOverflowInt32", "",
       [](CacheSpec& s) {
         s.max_sequences = kMaxSequences;
         s.capacity = INT32_MAX;
       }},
      {"FullCellsOneAboveLimit", "",
       [](CacheSpec& s) {
         s.groups = {Group(Full())};
         s.max_sequences = 1 << 12;
         s.capacity = (1 << 12) + 1;
       }},
      // max_sequences * memory + max_batch = kMaxCellsPerGroup + 1 even though
      // max_sequences * capacity would be exactly the limit.
      {"SlidingCellsOneAboveLimit", "",
       [](CacheSpec& s) {
         s.groups = {Group(Sliding(static_cast<int32_t>(kMaxCellsPerGroup) - 1))};
         s.max_sequences = 1;
         s.capacity = static_cast<int32_t>(kMaxCellsPerGroup);
         s.max_batch = 2;
       }},
      // 2^24 cells * 1024 layers * 4096 heads * 2 * 8192 elements * 4 bytes = 2^66 bytes.
      {"ArenaBytesOverflow", "",
       [](CacheSpec& s) {
         s.dtype = DType::kF32;
         s.max_sequences = 1 << 12;
         s.capacity = 1 << 12;
         s.groups = {Group(Full(), kMaxLayersPerGroup, kMaxHeads, kMaxHeadDim, kMaxHeadDim)};
       }},
      // Exactly kMaxCacheBytes in one group plus one more group.
      {"CacheBytesAboveLimit", "",
       [](CacheSpec& s) {
         s.dtype = DType::kF16;
         s.max_sequences = 1 << 12;
         s.capacity = 1 << 12;
         s.groups = {Group(Full(), 1024, 1024, 16, 16), Group(Full())};
       }},
  };
  return cases;
}

INSTANTIATE_TEST_SUITE_P(AllFields, ValidateSpecRejects, ::testing::ValuesIn(BadSpecs()),
                         [](const ::testing::TestParamInfo<BadSpecCase>& info) {
                           return info.param.label;
                         });

TEST(ValidateSpecTest, LimitsAreInclusive) {
  // Exactly kMaxCacheBytes: 2^24 cells * 1024 layers * 1024 heads * 32 elements * 2 bytes.
  CacheSpec big = Spec(DType::kF16, 1 << 12, 1 << 12, 16, {Group(Full(), 1024, 1024, 16, 16)});
  EXPECT_TRUE(ValidateSpec(big).ok()) << ValidateSpec(big);
  EXPECT_EQ(CacheBytes(big), kMaxCacheBytes);
  big = Spec(DType::kF16, kMaxSequences, 1, 1, {Group(Full())});
  EXPECT_TRUE(ValidateSpec(big).ok()) << ValidateSpec(big);
  // max_sequences * capacity == kMaxCellsPerGroup is valid.
  CacheSpec s = Spec(DType::kF16, 1 << 12, 1 << 12, 16, {Group(Full())});
  ASSERT_EQ(int64_t{s.max_sequences} * s.capacity, kMaxCellsPerGroup);
  EXPECT_TRUE(ValidateSpec(s).ok()) << ValidateSpec(s);
  const AttentionGeometry geo = ComputeAttentionGeometry(s, 0);
  EXPECT_EQ(geo.cells, kMaxCellsPerGroup);
  EXPECT_EQ(geo.bytes, static_cast<size_t>(kMaxCellsPerGroup) * 16);
}

// One row of the capacity rule: cells and effective memory for a window kind.
struct GeometryCase {
  std::string label;
  int32_t max_sequences;
  WindowSpec window;
  int64_t cells;
  int32_t memory;
};

class GeometryTest : public ::testing::TestWithParam<GeometryCase> {};

TEST_P(GeometryTest, FollowsTheSeedCapacityRule) {
  const GeometryCase& c = GetParam();
  // capacity 16, max_batch 4, 3 layers of 2 heads, head_dim_k 8, head_dim_v 4, F16.
  CacheSpec spec = Spec(DType::kF16, c.max_sequences, 16, 4, {Group(c.window, 3, 2, 8, 4)});
  ASSERT_TRUE(ValidateSpec(spec).ok()) << ValidateSpec(spec);
  const AttentionGeometry geo = ComputeAttentionGeometry(spec, 0);
  EXPECT_EQ(geo.cells, c.cells);
  EXPECT_EQ(geo.memory, c.memory);
  EXPECT_EQ(geo.k_row_bytes, 2u * 8 * 2);
  EXPECT_EQ(geo.v_row_bytes, 2u * 4 * 2);
  EXPECT_EQ(geo.bytes, static_cast<size_t>(3 * c.cells * (32 + 16)));
  EXPECT_EQ(GroupTokenBytes(spec, 0), 3u * (32 + 16));
  EXPECT_EQ(CacheBytes(spec), geo.bytes);

  // A cache created from the spec reports the same geometry and holds exactly those bytes.
  std::unique_ptr<Device> device = testutil::MakeTestDevice(size_t{1} << 24);
  absl::StatusOr<std::unique_ptr<Cache>> cache = Cache::Create(spec, device.get());
  ASSERT_TRUE(cache.ok()) << cache.status();
  const CacheUsage usage = (*cache)->Usage();
  ASSERT_EQ(usage.groups.size(), 1u);
  EXPECT_EQ(usage.groups[0].cells_total, c.cells);
  EXPECT_EQ(usage.groups[0].cells_used, 0);
  EXPECT_EQ(usage.groups[0].memory, c.memory);
  EXPECT_EQ(usage.groups[0].bytes, geo.bytes);
  EXPECT_EQ(usage.bytes_held, geo.bytes);
  EXPECT_EQ(usage.sequences_live, 0);
  EXPECT_EQ(device->used_bytes(), geo.bytes);
}

INSTANTIATE_TEST_SUITE_P(
    CapacityRule, GeometryTest,
    ::testing::Values(
        GeometryCase{"Full", 3, Full(), 3 * 16, kUnlimitedMemory},
        GeometryCase{"Chunked", 3, Chunked(4), 3 * 16, kUnlimitedMemory},
        // memory 0 means memory = window; one sequence keeps it as is.
        GeometryCase{"SlidingOneSequence", 1, Sliding(4), 1 * 4 + 4, 4},
        // With parallel sequences memory is raised to window + 1 (the stop token).
        GeometryCase{"SlidingRaisedToWindowPlusOne", 3, Sliding(4), 3 * 5 + 4, 5},
        GeometryCase{"SlidingMemoryEqualWindowRaised", 3, Sliding(4, 4), 3 * 5 + 4, 5},
        GeometryCase{"SlidingMemoryAboveWindowKept", 3, Sliding(4, 6), 3 * 6 + 4, 6},
        GeometryCase{"SlidingMemoryOneBelowCapacity", 1, Sliding(15), 15 + 4, 15},
        // memory >= capacity is unlimited: max_sequences * capacity cells.
        GeometryCase{"SlidingMemoryEqualCapacity", 3, Sliding(4, 16), 3 * 16, kUnlimitedMemory},
        GeometryCase{"SlidingMemoryAboveCapacity", 3, Sliding(4, 17), 3 * 16, kUnlimitedMemory},
        GeometryCase{"SlidingRaiseReachesCapacity", 3, Sliding(15), 3 * 16, kUnlimitedMemory},
        GeometryCase{"SlidingWindowAboveCapacity", 1, Sliding(20), 16, kUnlimitedMemory},
        GeometryCase{"SlidingWindowEqualCapacity", 1, Sliding(16), 16, kUnlimitedMemory}),
    [](const ::testing::TestParamInfo<GeometryCase>& info) { return info.param.label; });

TEST(PayloadBytesTest, SumsEveryGroupAndLayer) {
  CacheSpec spec =
      Spec(DType::kBF16, 2, 32, 8, {Group(Full(), 2, 3, 4, 2), Group(Sliding(4), 1, 1, 8, 16)});
  ASSERT_TRUE(ValidateSpec(spec).ok());
  const size_t per_token = 2 * 3 * (4 + 2) * 2 + 1 * 1 * (8 + 16) * 2;
  EXPECT_EQ(GroupTokenBytes(spec, 0), 2u * 3 * (4 + 2) * 2);
  EXPECT_EQ(GroupTokenBytes(spec, 1), 1u * 1 * (8 + 16) * 2);
  EXPECT_EQ(AppendPayloadBytes(spec, 1, 1), per_token);
  EXPECT_EQ(AppendPayloadBytes(spec, 5, 2), 5 * per_token);
  EXPECT_EQ(AppendPayloadBytes(spec, 0, 0), 0u);
  spec.dtype = DType::kF32;
  EXPECT_EQ(AppendPayloadBytes(spec, 3, 3), 3 * 2 * per_token);
  // The pattern builder agrees with the engine's arithmetic.
  EXPECT_EQ(testutil::AppendPayload(spec, {1, 2, 3}).size(), AppendPayloadBytes(spec, 3, 1));
}

TEST(CacheBytesTest, SumsGroupArenas) {
  CacheSpec spec =
      Spec(DType::kF32, 2, 32, 8, {Group(Full(), 2, 3, 4, 2), Group(Sliding(4), 1, 1, 8, 16)});
  ASSERT_TRUE(ValidateSpec(spec).ok());
  // Full: 64 cells * 2 layers * 3 heads * 6 elements * 4 bytes; sliding: memory 5 -> 2*5+8 = 18
  // cells * 24 elements * 4 bytes.
  EXPECT_EQ(ComputeAttentionGeometry(spec, 0).bytes, 64u * 2 * 3 * 6 * 4);
  EXPECT_EQ(ComputeAttentionGeometry(spec, 1).bytes, 18u * 24 * 4);
  EXPECT_EQ(CacheBytes(spec), 64u * 2 * 3 * 6 * 4 + 18u * 24 * 4);
}

TEST(SpecEqualityTest, EveryFieldMatters) {
  const CacheSpec base = ValidSpec();
  EXPECT_EQ(base, ValidSpec());
  EXPECT_FALSE(base != ValidSpec());
  const std::vector<std::function<void(CacheSpec&)>> mutations = {
      [](CacheSpec& s) { s.name = "other"; },
      [](CacheSpec& s) { s.dtype = DType::kBF16; },
      [](CacheSpec& s) { s.max_sequences = 5; },
      [](CacheSpec& s) { s.capacity = 65; },
      [](CacheSpec& s) { s.max_batch = 9; },
      [](CacheSpec& s) { s.groups.pop_back(); },
      [](CacheSpec& s) { s.groups[0].num_layers = 3; },
      [](CacheSpec& s) { s.groups[0].attention.num_kv_heads = 1; },
      [](CacheSpec& s) { s.groups[0].attention.head_dim_k = 4; },
      [](CacheSpec& s) { s.groups[0].attention.head_dim_v = 4; },
      [](CacheSpec& s) { s.groups[1].attention.window.window = 15; },
      [](CacheSpec& s) { s.groups[1].attention.window.memory = 20; },
      [](CacheSpec& s) { s.groups[2].attention.window.chunk = 4; },
      [](CacheSpec& s) { s.groups[2].attention.window.kind = WindowKind::kFull; },
      [](CacheSpec& s) { s.groups[0].attention.rope.type = RopeType::kNeox; },
      [](CacheSpec& s) { s.groups[0].attention.rope.dims = 4; },
      [](CacheSpec& s) { s.groups[0].attention.rope.base = 500.0f; },
      [](CacheSpec& s) { s.groups[0].attention.rope.freq_scale = 0.5f; },
  };
  for (size_t i = 0; i < mutations.size(); ++i) {
    CacheSpec changed = ValidSpec();
    mutations[i](changed);
    EXPECT_NE(base, changed) << "mutation " << i;
    EXPECT_FALSE(base == changed) << "mutation " << i;
  }
}

// ---- Rotating and Recurrent groups ---------------------------------------------------------

// full attention, rotating (max_size 16, NEOX over 8 of head_dim_k 8), recurrent with delta.
CacheSpec ValidHybridSpec() {
  return Spec(DType::kF16, 4, 64, 8,
              {Group(Full(), 1, 1, 4, 4), RotatingGroup(16, 2, 2, 8, 4, Rope(RopeType::kNeox, 8)),
               RecurrentGroup(2, 3, 16, 2, 8, 4)});
}

TEST(ValidateSpecTest, AcceptsValidRotatingAndRecurrentGroups) {
  EXPECT_TRUE(ValidateSpec(ValidHybridSpec()).ok()) << ValidateSpec(ValidHybridSpec());
  CacheSpec s = ValidHybridSpec();
  s.groups[1].rotating.max_size = s.capacity;  // max_size == capacity
  s.groups[1].rotating.rope = RopeSpec{};      // no rope
  EXPECT_TRUE(ValidateSpec(s).ok()) << ValidateSpec(s);
  s.groups[1].rotating.max_size = 1;
  EXPECT_TRUE(ValidateSpec(s).ok()) << ValidateSpec(s);
  // Conv state only (lfm2): no delta state.
  s.groups[2] = RecurrentGroup(1, 3, 16, 0, 0, 0);
  EXPECT_TRUE(ValidateSpec(s).ok()) << ValidateSpec(s);
  s.groups[2].recurrent.conv_tail = kMaxConvTail;
  s.groups[2].recurrent.conv_dim = 1;
  EXPECT_TRUE(ValidateSpec(s).ok()) << ValidateSpec(s);
  // A cache of only Rotating or only Recurrent groups.
  EXPECT_TRUE(ValidateSpec(Spec(DType::kF32, 1, 8, 8, {RotatingGroup(8)})).ok());
  EXPECT_TRUE(ValidateSpec(Spec(DType::kBF16, 1, 8, 8, {RecurrentGroup()})).ok());
}

struct ExactMessageCase {
  std::string label;
  std::string message;  // the whole INVALID_ARGUMENT message
  std::function<void(CacheSpec&)> mutate;
};

class ValidateHybridSpecRejects : public ::testing::TestWithParam<ExactMessageCase> {};

TEST_P(ValidateHybridSpecRejects, WithInvalidArgumentNamingFieldAndValue) {
  CacheSpec spec = ValidHybridSpec();
  GetParam().mutate(spec);
  const absl::Status status = ValidateSpec(spec);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_EQ(std::string(status.message()), GetParam().message);
}

std::vector<ExactMessageCase> BadHybridSpecs() {
  return {
      {"RotatingZeroHeads", "groups[1].rotating.num_kv_heads = 0 is out of range [1, 4096]",
       [](CacheSpec& s) { s.groups[1].rotating.num_kv_heads = 0; }},
      {"RotatingTooManyHeads", "groups[1].rotating.num_kv_heads = 4097 is out of range [1, 4096]",
       [](CacheSpec& s) { s.groups[1].rotating.num_kv_heads = kMaxHeads + 1; }},
      {"RotatingZeroHeadDimK", "groups[1].rotating.head_dim_k = 0 is out of range [1, 8192]",
       [](CacheSpec& s) { s.groups[1].rotating.head_dim_k = 0; }},
      {"RotatingNegativeHeadDimV", "groups[1].rotating.head_dim_v = -4 is out of range [1, 8192]",
       [](CacheSpec& s) { s.groups[1].rotating.head_dim_v = -4; }},
      {"RotatingTooBigHeadDimV", "groups[1].rotating.head_dim_v = 8193 is out of range [1, 8192]",
       [](CacheSpec& s) { s.groups[1].rotating.head_dim_v = kMaxHeadDim + 1; }},
      {"RotatingZeroMaxSize", "groups[1].rotating.max_size = 0 is out of range [1, 64]",
       [](CacheSpec& s) { s.groups[1].rotating.max_size = 0; }},
      {"RotatingNegativeMaxSize", "groups[1].rotating.max_size = -1 is out of range [1, 64]",
       [](CacheSpec& s) { s.groups[1].rotating.max_size = -1; }},
      {"RotatingMaxSizeAboveCapacity", "groups[1].rotating.max_size = 65 is out of range [1, 64]",
       [](CacheSpec& s) { s.groups[1].rotating.max_size = 65; }},
      {"RotatingOddRopeDims",
       "groups[1].rotating.rope.dims = 7 must be even and in [2, head_dim_k = 8]",
       [](CacheSpec& s) { s.groups[1].rotating.rope.dims = 7; }},
      {"RotatingRopeDimsAboveHeadDim",
       "groups[1].rotating.rope.dims = 10 must be even and in [2, head_dim_k = 8]",
       [](CacheSpec& s) { s.groups[1].rotating.rope.dims = 10; }},
      {"RotatingZeroRopeDims",
       "groups[1].rotating.rope.dims = 0 must be even and in [2, head_dim_k = 8]",
       [](CacheSpec& s) { s.groups[1].rotating.rope.dims = 0; }},
      {"RotatingZeroRopeBase", "groups[1].rotating.rope.base = 0 must be finite and > 0",
       [](CacheSpec& s) { s.groups[1].rotating.rope.base = 0.0f; }},
      {"RotatingNegativeFreqScale",
       "groups[1].rotating.rope.freq_scale = -1 must be finite and > 0",
       [](CacheSpec& s) { s.groups[1].rotating.rope.freq_scale = -1.0f; }},
      {"RotatingZeroLayers", "groups[1].num_layers = 0 is out of range [1, 1024]",
       [](CacheSpec& s) { s.groups[1].num_layers = 0; }},
      {"RecurrentZeroConvTail", "groups[2].recurrent.conv_tail = 0 is out of range [1, 1024]",
       [](CacheSpec& s) { s.groups[2].recurrent.conv_tail = 0; }},
      {"RecurrentTooLongConvTail", "groups[2].recurrent.conv_tail = 1025 is out of range [1, 1024]",
       [](CacheSpec& s) { s.groups[2].recurrent.conv_tail = kMaxConvTail + 1; }},
      {"RecurrentZeroConvDim", "groups[2].recurrent.conv_dim = 0 is out of range [1, 1048576]",
       [](CacheSpec& s) { s.groups[2].recurrent.conv_dim = 0; }},
      {"RecurrentTooBigConvDim",
       "groups[2].recurrent.conv_dim = 1048577 is out of range [1, 1048576]",
       [](CacheSpec& s) { s.groups[2].recurrent.conv_dim = kMaxConvDim + 1; }},
      {"RecurrentNegativeVHeads", "groups[2].recurrent.num_v_heads = -1 is out of range [0, 4096]",
       [](CacheSpec& s) { s.groups[2].recurrent.num_v_heads = -1; }},
      {"RecurrentTooManyVHeads", "groups[2].recurrent.num_v_heads = 4097 is out of range [0, 4096]",
       [](CacheSpec& s) { s.groups[2].recurrent.num_v_heads = kMaxHeads + 1; }},
      {"RecurrentZeroHeadVDim", "groups[2].recurrent.head_v_dim = 0 is out of range [1, 8192]",
       [](CacheSpec& s) { s.groups[2].recurrent.head_v_dim = 0; }},
      {"RecurrentTooBigHeadKDim", "groups[2].recurrent.head_k_dim = 8193 is out of range [1, 8192]",
       [](CacheSpec& s) { s.groups[2].recurrent.head_k_dim = kMaxHeadDim + 1; }},
      {"RecurrentHeadDimsWithoutVHeads",
       "groups[2].recurrent.head_v_dim = 8 and head_k_dim = 4 must be 0 when num_v_heads is 0",
       [](CacheSpec& s) { s.groups[2].recurrent.num_v_heads = 0; }},
      {"RecurrentHeadKDimWithoutVHeads",
       "groups[2].recurrent.head_v_dim = 0 and head_k_dim = 4 must be 0 when num_v_heads is 0",
       [](CacheSpec& s) {
         s.groups[2].recurrent.num_v_heads = 0;
         s.groups[2].recurrent.head_v_dim = 0;
       }},
      {"RotatingRingRowsAboveLimit",
       "groups[0] needs 16781312 ring rows (max_sequences x max_size), more than 16777216",
       [](CacheSpec& s) {
         s.max_sequences = 1 << 12;
         s.capacity = 1 << 13;
         s.groups = {RotatingGroup((1 << 12) + 1)};
       }},
  };
}

INSTANTIATE_TEST_SUITE_P(RotatingAndRecurrent, ValidateHybridSpecRejects,
                         ::testing::ValuesIn(BadHybridSpecs()),
                         [](const ::testing::TestParamInfo<ExactMessageCase>& info) {
                           return info.param.label;
                         });

TEST(ValidateSpecTest, RotatingRingRowsAtTheLimitAreValid) {
  const CacheSpec s = Spec(DType::kF16, 1 << 12, 1 << 12, 1, {RotatingGroup(1 << 12)});
  EXPECT_TRUE(ValidateSpec(s).ok()) << ValidateSpec(s);
  EXPECT_EQ(ComputeRotatingGeometry(s, 0).bytes, static_cast<size_t>(kMaxCellsPerGroup) * 16);
}

TEST(ValidateSpecTest, RecurrentStatesBeyondCacheBytesLimitAreRejected) {
  // One state is 1024 layers x (1024 x 2^20 x 4 bytes) = 2^42 bytes; 2^9 slots = 2^51 > 2^50.
  CacheSpec s = Spec(DType::kF32, 1 << 9, 1, 1,
                     {RecurrentGroup(kMaxLayersPerGroup, kMaxConvTail, kMaxConvDim, 0, 0, 0)});
  EXPECT_EQ(ValidateSpec(s).code(), absl::StatusCode::kInvalidArgument) << ValidateSpec(s);
  s.max_sequences = 1 << 8;  // exactly 2^50
  EXPECT_TRUE(ValidateSpec(s).ok()) << ValidateSpec(s);
  EXPECT_EQ(CacheBytes(s), kMaxCacheBytes);
}

TEST(GeometryTest, RotatingGroupIsOneRingPerSequence) {
  // 3 sequences, max_size 5, 2 layers of 2 heads, head_dim_k 8, head_dim_v 4, BF16.
  const CacheSpec spec = Spec(DType::kBF16, 3, 16, 4, {RotatingGroup(5, 2, 2, 8, 4)});
  ASSERT_TRUE(ValidateSpec(spec).ok()) << ValidateSpec(spec);
  const RotatingGeometry geo = ComputeRotatingGeometry(spec, 0);
  EXPECT_EQ(geo.rings, 3);
  EXPECT_EQ(geo.max_size, 5);
  EXPECT_EQ(geo.k_row_bytes, 2u * 8 * 2);
  EXPECT_EQ(geo.v_row_bytes, 2u * 4 * 2);
  EXPECT_EQ(geo.bytes, 2u * 3 * 5 * (32 + 16));
  EXPECT_EQ(GroupTokenBytes(spec, 0), 2u * (32 + 16));
  EXPECT_EQ(GroupStateBytes(spec, 0), 0u);
  EXPECT_EQ(CacheBytes(spec), geo.bytes);
  EXPECT_TRUE(RequiresContiguousPositions(spec));
}

TEST(GeometryTest, RecurrentGroupIsOneSlotPerSequence) {
  // 3 sequences, 2 layers; conv 3 x 16 in F16, delta 2 x 8 x 4 in float32.
  const CacheSpec spec = Spec(DType::kF16, 3, 16, 4, {RecurrentGroup(2, 3, 16, 2, 8, 4)});
  ASSERT_TRUE(ValidateSpec(spec).ok()) << ValidateSpec(spec);
  const RecurrentGeometry geo = ComputeRecurrentGeometry(spec, 0);
  EXPECT_EQ(geo.slots, 3);
  EXPECT_EQ(geo.conv_bytes, 3u * 16 * 2);
  EXPECT_EQ(geo.delta_bytes, 2u * 8 * 4 * 4);
  EXPECT_EQ(geo.state_bytes, 2u * (96 + 256));
  EXPECT_EQ(geo.bytes, 3u * 2 * (96 + 256));
  EXPECT_EQ(GroupTokenBytes(spec, 0), 0u);
  EXPECT_EQ(GroupStateBytes(spec, 0), 2u * (96 + 256));
  EXPECT_EQ(CacheBytes(spec), geo.bytes);
  EXPECT_TRUE(RequiresContiguousPositions(spec));
  // Without a delta state the slot holds the conv state only, in the cache dtype.
  CacheSpec conv_only = Spec(DType::kF32, 2, 16, 4, {RecurrentGroup(3, 2, 5, 0, 0, 0)});
  ASSERT_TRUE(ValidateSpec(conv_only).ok());
  const RecurrentGeometry conv = ComputeRecurrentGeometry(conv_only, 0);
  EXPECT_EQ(conv.conv_bytes, 2u * 5 * 4);
  EXPECT_EQ(conv.delta_bytes, 0u);
  EXPECT_EQ(conv.state_bytes, 3u * 40);
  EXPECT_EQ(conv.bytes, 2u * 3 * 40);
}

TEST(GeometryTest, OnlyAttentionCachesAcceptGaps) {
  EXPECT_FALSE(RequiresContiguousPositions(ValidSpec()));
  EXPECT_TRUE(RequiresContiguousPositions(ValidHybridSpec()));
  EXPECT_TRUE(
      RequiresContiguousPositions(Spec(DType::kF16, 1, 8, 8, {Group(Full()), RecurrentGroup()})));
}

TEST(GeometryTest, HybridCacheCreatesAndReportsEveryGroup) {
  const CacheSpec spec = ValidHybridSpec();
  const size_t attention = ComputeAttentionGeometry(spec, 0).bytes;
  const size_t rotating = ComputeRotatingGeometry(spec, 1).bytes;
  const size_t recurrent = ComputeRecurrentGeometry(spec, 2).bytes;
  EXPECT_EQ(attention, 4u * 64 * 8 * 2);
  EXPECT_EQ(rotating, 2u * 4 * 16 * (2 * 8 + 2 * 4) * 2);
  EXPECT_EQ(recurrent, 4u * 2 * (3 * 16 * 2 + 2 * 8 * 4 * 4));
  EXPECT_EQ(CacheBytes(spec), attention + rotating + recurrent);

  std::unique_ptr<Device> device = testutil::MakeTestDevice(size_t{1} << 24);
  absl::StatusOr<std::unique_ptr<Cache>> cache = Cache::Create(spec, device.get());
  ASSERT_TRUE(cache.ok()) << cache.status();
  const CacheUsage usage = (*cache)->Usage();
  ASSERT_EQ(usage.groups.size(), 3u);
  EXPECT_EQ(usage.groups[1].cells_total, 4 * 16);  // rings x max_size
  EXPECT_EQ(usage.groups[2].cells_total, 4);       // slots
  EXPECT_EQ(usage.groups[1].cells_used, 0);
  EXPECT_EQ(usage.groups[2].cells_used, 0);
  EXPECT_EQ(usage.groups[1].bytes, rotating);
  EXPECT_EQ(usage.groups[2].bytes, recurrent);
  EXPECT_EQ(usage.bytes_held, CacheBytes(spec));
  EXPECT_EQ(device->used_bytes(), CacheBytes(spec));
  EXPECT_EQ(device->used_bytes(MemoryPool::kSnapshot), 0u);
  // A budget one byte short refuses the cache and holds nothing.
  std::unique_ptr<Device> small = testutil::MakeTestDevice(CacheBytes(spec) - 1);
  absl::StatusOr<std::unique_ptr<Cache>> refused = Cache::Create(spec, small.get());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_EQ(small->used_bytes(), 0u);
}

TEST(PayloadBytesTest, RecurrentStatesPerSequenceOrPerSpeculativeToken) {
  const CacheSpec spec = ValidHybridSpec();
  const size_t attention = 1 * 1 * (4 + 4) * 2;
  const size_t rotating = 2 * 2 * (8 + 4) * 2;
  const size_t state = 2 * (3 * 16 * 2 + 2 * 8 * 4 * 4);
  EXPECT_EQ(GroupTokenBytes(spec, 1), rotating);
  EXPECT_EQ(GroupStateBytes(spec, 2), state);
  EXPECT_EQ(GroupStateBytes(spec, 0), 0u);
  EXPECT_EQ(GroupStateBytes(spec, 1), 0u);
  EXPECT_EQ(AppendPayloadBytes(spec, 5, 2), 5 * (attention + rotating) + 2 * state);
  EXPECT_EQ(AppendPayloadBytes(spec, 5, 2, /*speculative=*/false),
            5 * (attention + rotating) + 2 * state);
  EXPECT_EQ(AppendPayloadBytes(spec, 5, 2, /*speculative=*/true),
            5 * (attention + rotating) + 5 * state);
  EXPECT_EQ(AppendPayloadBytes(spec, 1, 1, true), attention + rotating + state);
  // The pattern builders agree with the engine's arithmetic, both ways.
  const std::vector<Token> tokens = {{0, 0}, {1, 0}, {0, 1}, {1, 1}, {0, 2}};
  EXPECT_EQ(testutil::PayloadFor(spec, tokens).size(), AppendPayloadBytes(spec, 5, 2));
  EXPECT_EQ(testutil::PayloadFor(spec, tokens, 0, true).size(),
            AppendPayloadBytes(spec, 5, 2, true));
  // Attention-only caches are unaffected by `speculative`.
  EXPECT_EQ(AppendPayloadBytes(ValidSpec(), 3, 1, true), AppendPayloadBytes(ValidSpec(), 3, 1));
}

TEST(SpecEqualityTest, RotatingAndRecurrentFieldsMatter) {
  const CacheSpec base = ValidHybridSpec();
  const std::vector<std::function<void(CacheSpec&)>> mutations = {
      [](CacheSpec& s) { s.groups[1].rotating.num_kv_heads = 1; },
      [](CacheSpec& s) { s.groups[1].rotating.head_dim_k = 4; },
      [](CacheSpec& s) { s.groups[1].rotating.head_dim_v = 8; },
      [](CacheSpec& s) { s.groups[1].rotating.max_size = 15; },
      [](CacheSpec& s) { s.groups[1].rotating.rope.type = RopeType::kNormal; },
      [](CacheSpec& s) { s.groups[1].rotating.rope.base = 500.0f; },
      [](CacheSpec& s) { s.groups[2].recurrent.conv_tail = 4; },
      [](CacheSpec& s) { s.groups[2].recurrent.conv_dim = 8; },
      [](CacheSpec& s) { s.groups[2].recurrent.num_v_heads = 1; },
      [](CacheSpec& s) { s.groups[2].recurrent.head_v_dim = 4; },
      [](CacheSpec& s) { s.groups[2].recurrent.head_k_dim = 8; },
      [](CacheSpec& s) { s.groups[2].num_layers = 1; },
      [](CacheSpec& s) { s.groups[1].kind = GroupKind::kAttention; },
  };
  for (size_t i = 0; i < mutations.size(); ++i) {
    CacheSpec changed = ValidHybridSpec();
    mutations[i](changed);
    EXPECT_NE(base, changed) << "mutation " << i;
  }
  // Fields of the other kinds are ignored.
  CacheSpec same = ValidHybridSpec();
  same.groups[1].attention.num_kv_heads = 7;
  same.groups[1].recurrent.conv_dim = 9;
  same.groups[2].rotating.max_size = 3;
  same.groups[0].rotating.max_size = 3;
  EXPECT_EQ(base, same);
  EXPECT_STREQ(GroupKindName(GroupKind::kRotating), "rotating");
  EXPECT_STREQ(GroupKindName(GroupKind::kRecurrent), "recurrent");
}

}  // namespace
}  // namespace kvmesh
