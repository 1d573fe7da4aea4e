// Cache::CopyPrefix: shared cells, replacement of dst, edge cases and max_sequences.
#include <cstdint>
#include <optional>
#include <vector>

#include "cache/cache.h"
#include "gtest/gtest.h"
#include "tests/unit/cache_test_util.h"

namespace kvmesh {
namespace {

using testutil::AppendRange;
using testutil::AppendTokens;
using testutil::CacheState;
using testutil::CaptureState;
using testutil::Full;
using testutil::Group;
using testutil::Ids;
using testutil::Range;
using testutil::ReadPayload;
using testutil::Rope;
using testutil::SameBytes;
using testutil::SameState;
using testutil::Sliding;
using testutil::Spec;
using testutil::StoredPositions;
using testutil::TestCache;

using Positions = std::vector<std::vector<int32_t>>;

const SequenceInfo* FindSeq(const std::vector<SequenceInfo>& seqs, int64_t seq) {
  for (const SequenceInfo& s : seqs) {
    if (s.seq == seq) return &s;
  }
  return nullptr;
}

class CopyPrefixTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // Full group and a sliding group (window 2, three sequences: memory 3, 3 * 3 + 8 cells).
    spec_ = Spec(
        DType::kF16, 3, 32, 8,
        {Group(Full(), 2, 2, 4, 2, Rope(RopeType::kNormal, 4)), Group(Sliding(2), 1, 1, 2, 2)});
    tc_.emplace(spec_);
    ASSERT_NE(tc_->cache, nullptr);
    ASSERT_TRUE(AppendRange(cache(), 0, 0, 8).ok());  // one batch: nothing pruned
  }
  Cache& cache() { return *tc_->cache; }

  CacheSpec spec_;
  std::optional<TestCache> tc_;
};

TEST_F(CopyPrefixTest, SharesCellsInsteadOfCopying) {
  ASSERT_TRUE(cache().CopyPrefix(0, 1, 5).ok());
  const CacheUsage usage = cache().Usage();
  EXPECT_EQ(usage.groups[0].cells_used, 8);
  EXPECT_EQ(usage.groups[1].cells_used, 8);
  EXPECT_EQ(usage.sequences_live, 2);
  absl::StatusOr<ReadResult> read = cache().Read(1, 0, std::nullopt);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->positions, (Positions{Range(0, 5), Range(0, 5)}));
  EXPECT_TRUE(
      SameBytes(ReadPayload(spec_, {Ids(0, Range(0, 5)), Ids(0, Range(0, 5))}), read->payload));

  const std::vector<SequenceInfo> seqs = cache().ListSequences();
  ASSERT_EQ(seqs.size(), 2u);
  const SequenceInfo* src = FindSeq(seqs, 0);
  const SequenceInfo* dst = FindSeq(seqs, 1);
  ASSERT_NE(src, nullptr);
  ASSERT_NE(dst, nullptr);
  EXPECT_EQ(src->groups[0].stored, 8);
  EXPECT_EQ(src->groups[0].shared, 5);
  EXPECT_EQ(src->groups[1].shared, 5);
  EXPECT_EQ(dst->offset, 5);
  EXPECT_EQ(dst->groups[0].stored, 5);
  EXPECT_EQ(dst->groups[0].shared, 5);
  EXPECT_EQ(dst->groups[0].first, 0);
  EXPECT_EQ(dst->groups[0].last, 4);
}

TEST_F(CopyPrefixTest, LengthBeyondTheSourceCopiesEverything) {
  ASSERT_TRUE(cache().CopyPrefix(0, 1, 1000).ok());
  EXPECT_EQ(StoredPositions(cache(), 1), (Positions{Range(0, 8), Range(0, 8)}));
  EXPECT_EQ(cache().Usage().groups[0].cells_used, 8);
}

TEST_F(CopyPrefixTest, ReplacesTheOldContentsOfDst) {
  ASSERT_TRUE(AppendRange(cache(), 1, 0, 6, /*salt=*/1).ok());
  ASSERT_EQ(cache().Usage().groups[0].cells_used, 14);
  ASSERT_TRUE(cache().CopyPrefix(0, 1, 3).ok());
  EXPECT_EQ(cache().Usage().groups[0].cells_used, 8);  // dst's own cells are free again
  absl::StatusOr<ReadResult> read = cache().Read(1, 0, std::nullopt);
  ASSERT_TRUE(read.ok());
  // Appending to seq 1 pruned seq 0's sliding group below 8 - 3 = 5: nothing there below 3.
  EXPECT_EQ(read->positions, (Positions{Range(0, 3), {}}));
  EXPECT_TRUE(SameBytes(ReadPayload(spec_, {Ids(0, Range(0, 3)), {}}), read->payload));
}

TEST_F(CopyPrefixTest, NothingBelowLengthLeavesDstEmpty) {
  ASSERT_TRUE(AppendTokens(cache(), {{2, 5}, {2, 6}}).ok());
  ASSERT_TRUE(AppendRange(cache(), 1, 0, 3, /*salt=*/1).ok());
  ASSERT_TRUE(cache().CopyPrefix(2, 1, 5).ok());
  EXPECT_EQ(cache().Read(1, 0, std::nullopt).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(FindSeq(cache().ListSequences(), 1), nullptr);
  EXPECT_EQ(cache().Usage().sequences_live, 2);
  EXPECT_EQ(cache().Usage().groups[0].cells_used, 10);
}

TEST_F(CopyPrefixTest, ZeroLengthAndUnknownSourceEmptyDst) {
  ASSERT_TRUE(AppendRange(cache(), 1, 0, 3, /*salt=*/1).ok());
  ASSERT_TRUE(cache().CopyPrefix(0, 1, 0).ok());
  EXPECT_EQ(cache().Read(1, 0, std::nullopt).status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(AppendRange(cache(), 1, 0, 3, /*salt=*/1).ok());
  ASSERT_TRUE(cache().CopyPrefix(9, 1, 5).ok());
  EXPECT_EQ(cache().Read(1, 0, std::nullopt).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(cache().Usage().sequences_live, 1);
  EXPECT_EQ(cache().Usage().groups[0].cells_used, 8);
  EXPECT_EQ(StoredPositions(cache(), 0), (Positions{Range(0, 8), Range(5, 8)}));
}

TEST_F(CopyPrefixTest, Errors) {
  const CacheState before = CaptureState(cache());
  EXPECT_EQ(cache().CopyPrefix(0, 0, 4).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache().CopyPrefix(0, 1, -1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache().CopyPrefix(-1, 1, 4).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache().CopyPrefix(0, -2, 4).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(SameState(before, CaptureState(cache())));
}

TEST_F(CopyPrefixTest, ReturnsTheOffsetDstGot) {
  EXPECT_EQ(cache().CopyPrefix(0, 1, 5, 0).value(), 5);
  EXPECT_EQ(cache().CopyPrefix(0, 1, 1000, 0).value(), 8);
  EXPECT_EQ(cache().CopyPrefix(0, 1, 0, 0).value(), 0);
  EXPECT_EQ(cache().CopyPrefix(9, 1, 5, 0).value(), 0);  // an unknown source: dst emptied
  // With a gap below length, dst's offset is one past the last position it got.
  ASSERT_TRUE(AppendTokens(cache(), {{2, 0}, {2, 1}, {2, 6}}).ok());
  EXPECT_EQ(cache().CopyPrefix(2, 1, 6, 0).value(), 2);
  EXPECT_EQ(cache().CopyPrefix(2, 1, 7, 0).value(), 7);
}

TEST_F(CopyPrefixTest, RequiredSourceOffsetRefusesAStaleSource) {
  ASSERT_TRUE(AppendRange(cache(), 1, 0, 3, /*salt=*/1).ok());
  // Met exactly, and met by more than the copy takes.
  EXPECT_EQ(cache().CopyPrefix(0, 2, 4, 8).value(), 4);
  EXPECT_EQ(cache().CopyPrefix(0, 2, 4, 4).value(), 4);
  const CacheState before = CaptureState(cache());
  // Not met: nothing changes, dst (seq 1) keeps its 3 positions.
  absl::StatusOr<int32_t> copied = cache().CopyPrefix(0, 1, 4, 9);
  EXPECT_EQ(copied.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(copied.status().message().find("offset 8, below the required 9"), std::string::npos)
      << copied.status();
  // A source that was removed (a stale index entry): refused, not an emptied dst.
  copied = cache().CopyPrefix(7, 1, 4, 4);
  EXPECT_EQ(copied.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(copied.status().message().find("stores nothing"), std::string::npos) << copied.status();
  EXPECT_TRUE(SameState(before, CaptureState(cache())));
  // A truncated source.
  ASSERT_TRUE(cache().Remove(0, 6, std::nullopt).ok());
  const CacheState truncated = CaptureState(cache());
  EXPECT_EQ(cache().CopyPrefix(0, 1, 8, 8).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(SameState(truncated, CaptureState(cache())));
  EXPECT_EQ(cache().CopyPrefix(0, 1, 8, 6).value(), 6);
}

TEST_F(CopyPrefixTest, RequiredSourceOffsetArgumentErrors) {
  const CacheState before = CaptureState(cache());
  absl::StatusOr<int32_t> copied = cache().CopyPrefix(0, 1, 4, -1);
  EXPECT_EQ(copied.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(copied.status().message().find("require_src_offset"), std::string::npos);
  // A copy of nothing has nothing to require of src.
  copied = cache().CopyPrefix(0, 1, 0, 3);
  EXPECT_EQ(copied.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(copied.status().message().find("length = 0"), std::string::npos);
  EXPECT_TRUE(SameState(before, CaptureState(cache())));
}

TEST_F(CopyPrefixTest, MaxSequences) {
  ASSERT_TRUE(AppendRange(cache(), 1, 0, 2).ok());
  ASSERT_TRUE(AppendRange(cache(), 2, 0, 2).ok());
  const CacheState before = CaptureState(cache());
  EXPECT_EQ(cache().CopyPrefix(0, 3, 4).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(SameState(before, CaptureState(cache())));
  // Nothing to copy: dst stays empty, no new live sequence.
  EXPECT_TRUE(cache().CopyPrefix(0, 3, 0).ok());
  EXPECT_TRUE(SameState(before, CaptureState(cache())));
  // Replacing a live dst keeps the count.
  EXPECT_TRUE(cache().CopyPrefix(0, 2, 4).ok());
  EXPECT_EQ(cache().Usage().sequences_live, 3);
  EXPECT_TRUE(cache().CopyPrefix(0, 1, 0).ok());
  EXPECT_EQ(cache().Usage().sequences_live, 2);
  EXPECT_TRUE(cache().CopyPrefix(0, 3, 4).ok());
  EXPECT_EQ(cache().Usage().sequences_live, 3);
}

TEST_F(CopyPrefixTest, CopiesStayIndependent) {
  ASSERT_TRUE(cache().CopyPrefix(0, 1, 4).ok());
  // New positions on either side do not show on the other.
  ASSERT_TRUE(AppendRange(cache(), 1, 4, 6, /*salt=*/1).ok());
  ASSERT_TRUE(AppendRange(cache(), 0, 8, 10).ok());
  // Truncating the source keeps the copy's bytes.
  ASSERT_TRUE(cache().Remove(0, 2, std::nullopt).ok());
  absl::StatusOr<ReadResult> read = cache().Read(1, 0, std::nullopt);
  ASSERT_TRUE(read.ok());
  EXPECT_EQ(read->positions[0], Range(0, 6));
  std::vector<uint64_t> ids = Ids(0, Range(0, 4));
  for (uint64_t id : Ids(1, {4, 5}, 1)) ids.push_back(id);
  // Sliding: seq 1 dropped 0 when it appended (4 - 3), then 1 and 2 when seq 0 appended
  // (6 - 3).
  std::vector<uint64_t> sliding_ids(ids.begin() + 3, ids.end());
  EXPECT_EQ(read->positions[1], Range(3, 6));
  EXPECT_TRUE(SameBytes(ReadPayload(spec_, {ids, sliding_ids}), read->payload));
  read = cache().Read(0, 0, std::nullopt);
  ASSERT_TRUE(read.ok());
  EXPECT_EQ(read->positions[0], Range(0, 2));
  // Full: seq 0 keeps 0,1 (shared), seq 1 keeps 2,3 (once shared) and 4,5.
  EXPECT_EQ(cache().Usage().groups[0].cells_used, 6);
  // Dropping the copy frees the cells only it still references.
  ASSERT_TRUE(cache().Remove(1, 0, std::nullopt).ok());
  EXPECT_EQ(cache().Usage().groups[0].cells_used, 2);
}

TEST(CopyPrefixSlidingTest, CopiesWhatEachGroupStores) {
  // window 2, max_sequences 2 -> memory 3.
  const CacheSpec spec = Spec(DType::kF32, 2, 64, 4, {Group(Full()), Group(Sliding(2))});
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 4).ok());
  ASSERT_TRUE(AppendRange(cache, 0, 4, 8).ok());  // sliding drops < 1
  ASSERT_EQ(StoredPositions(cache, 0), (Positions{Range(0, 8), Range(1, 8)}));
  ASSERT_TRUE(cache.CopyPrefix(0, 1, 6).ok());
  absl::StatusOr<ReadResult> read = cache.Read(1, 0, std::nullopt);
  ASSERT_TRUE(read.ok());
  EXPECT_EQ(read->positions, (Positions{Range(0, 6), Range(1, 6)}));
  EXPECT_TRUE(
      SameBytes(ReadPayload(spec, {Ids(0, Range(0, 6)), Ids(0, Range(1, 6))}), read->payload));
  EXPECT_EQ(cache.Usage().groups[1].cells_used, 7);
  // The copy is a sequence of its own for pruning: appending to seq 0 prunes seq 1 by its own
  // offset (6 - 3 = 3), dropping its references to 1 and 2 only.
  ASSERT_TRUE(AppendRange(cache, 0, 8, 9).ok());  // seq 0 in batch: drops < 5
  EXPECT_EQ(StoredPositions(cache, 0), (Positions{Range(0, 9), Range(5, 9)}));
  EXPECT_EQ(StoredPositions(cache, 1), (Positions{Range(0, 6), Range(3, 6)}));
  // Cells of positions 3, 4 (seq 1 only), 5 (both), 6, 7, 8 (seq 0 only).
  EXPECT_EQ(cache.Usage().groups[1].cells_used, 6);
}

}  // namespace
}  // namespace kvmesh
