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
using testutil::Rope;
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
  HostDevice device(size_t{1} << 24);
  absl::StatusOr<std::unique_ptr<Cache>> cache = Cache::Create(spec, &device);
  ASSERT_TRUE(cache.ok()) << cache.status();
  const CacheUsage usage = (*cache)->Usage();
  ASSERT_EQ(usage.groups.size(), 1u);
  EXPECT_EQ(usage.groups[0].cells_total, c.cells);
  EXPECT_EQ(usage.groups[0].cells_used, 0);
  EXPECT_EQ(usage.groups[0].memory, c.memory);
  EXPECT_EQ(usage.groups[0].bytes, geo.bytes);
  EXPECT_EQ(usage.bytes_held, geo.bytes);
  EXPECT_EQ(usage.sequences_live, 0);
  EXPECT_EQ(device.used_bytes(), geo.bytes);
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

}  // namespace
}  // namespace kvmesh
