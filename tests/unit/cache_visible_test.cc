// Cache::Visible: the seed's buildMask in logical form.
#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "cache/cache.h"
#include "gtest/gtest.h"
#include "tests/unit/cache_test_util.h"

namespace kvmesh {
namespace {

using testutil::AppendRange;
using testutil::AppendTokens;
using testutil::Chunked;
using testutil::Full;
using testutil::Group;
using testutil::Range;
using testutil::Sliding;
using testutil::Spec;
using testutil::TestCache;

using Lists = std::vector<std::vector<int32_t>>;

class VisibleTest : public ::testing::Test {
 protected:
  static constexpr int kFull = 0;
  static constexpr int kSliding = 1;  // window 3, memory unlimited (keeps everything)
  static constexpr int kChunked = 2;  // chunk 4

  void SetUp() override {
    spec_ = Spec(DType::kF16, 3, 64, 16, {Group(Full()), Group(Sliding(3, 64)), Group(Chunked(4))});
    tc_.emplace(spec_);
    ASSERT_NE(tc_->cache, nullptr);
    ASSERT_TRUE(AppendRange(cache(), 0, 0, 10).ok());
    ASSERT_TRUE(AppendRange(cache(), 1, 0, 5).ok());
    ASSERT_TRUE(AppendTokens(cache(), {{2, 1}, {2, 5}, {2, 9}}).ok());
  }
  Cache& cache() { return *tc_->cache; }

  Lists Visible(int group, const std::vector<Query>& queries) {
    absl::StatusOr<Lists> v = cache().Visible(group, queries);
    EXPECT_TRUE(v.ok()) << v.status();
    return v.ok() ? *v : Lists{{-999}};
  }
  std::vector<int32_t> One(int group, int64_t seq, int32_t pos, bool non_causal = false) {
    const Lists v = Visible(group, {Query{seq, pos, non_causal}});
    EXPECT_EQ(v.size(), 1u);
    return v.empty() ? std::vector<int32_t>{-999} : v[0];
  }

  CacheSpec spec_;
  std::optional<TestCache> tc_;
};

TEST_F(VisibleTest, FullIsCausalPerSequence) {
  EXPECT_EQ(One(kFull, 0, 5), Range(0, 6));
  EXPECT_EQ(One(kFull, 0, 0), (std::vector<int32_t>{0}));
  EXPECT_EQ(One(kFull, 0, 20), Range(0, 10));
  EXPECT_EQ(One(kFull, 1, 7), Range(0, 5));
  EXPECT_EQ(One(kFull, 2, 6), (std::vector<int32_t>{1, 5}));
  EXPECT_EQ(One(kFull, 2, 0), (std::vector<int32_t>{}));
}

TEST_F(VisibleTest, NonCausalSeesLaterPositions) {
  EXPECT_EQ(One(kFull, 0, 5, true), Range(0, 10));
  EXPECT_EQ(One(kFull, 2, 0, true), (std::vector<int32_t>{1, 5, 9}));
}

TEST_F(VisibleTest, SlidingWindowKeepsPositionsAtLeastPosMinusWindow) {
  EXPECT_EQ(One(kSliding, 0, 5), Range(2, 6));  // 5 - 3 = 2 is visible
  EXPECT_EQ(One(kSliding, 0, 2), Range(0, 3));
  EXPECT_EQ(One(kSliding, 0, 3), Range(0, 4));
  EXPECT_EQ(One(kSliding, 0, 4), Range(1, 5));
  EXPECT_EQ(One(kSliding, 0, 12), (std::vector<int32_t>{9}));
  EXPECT_EQ(One(kSliding, 0, 13), (std::vector<int32_t>{}));
  EXPECT_EQ(One(kSliding, 0, 5, true), Range(2, 10));
  EXPECT_EQ(One(kSliding, 2, 8), (std::vector<int32_t>{5}));
}

TEST_F(VisibleTest, ChunkedSeesOnlyItsChunk) {
  EXPECT_EQ(One(kChunked, 0, 3), Range(0, 4));
  EXPECT_EQ(One(kChunked, 0, 4), (std::vector<int32_t>{4}));
  EXPECT_EQ(One(kChunked, 0, 6), Range(4, 7));
  EXPECT_EQ(One(kChunked, 0, 7), Range(4, 8));
  EXPECT_EQ(One(kChunked, 0, 8), (std::vector<int32_t>{8}));
  EXPECT_EQ(One(kChunked, 0, 11), Range(8, 10));
  EXPECT_EQ(One(kChunked, 0, 5, true), Range(4, 10));
  EXPECT_EQ(One(kChunked, 2, 7), (std::vector<int32_t>{5}));
}

TEST_F(VisibleTest, UnknownSequenceSeesNothing) {
  EXPECT_EQ(One(kFull, 7, 5), (std::vector<int32_t>{}));
  EXPECT_EQ(One(kSliding, 7, 5, true), (std::vector<int32_t>{}));
  EXPECT_EQ(One(kChunked, 7, 5), (std::vector<int32_t>{}));
}

TEST_F(VisibleTest, ManyQueriesAnswerInOrder) {
  const Lists v = Visible(
      kFull, {Query{1, 2, false}, Query{0, 1, false}, Query{9, 1, false}, Query{1, 2, true}});
  EXPECT_EQ(v, (Lists{{0, 1, 2}, {0, 1}, {}, {0, 1, 2, 3, 4}}));
}

TEST_F(VisibleTest, Errors) {
  EXPECT_EQ(cache().Visible(-1, {Query{0, 1, false}}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache().Visible(3, {Query{0, 1, false}}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache().Visible(kFull, {Query{0, 1, false}, Query{-1, 1, false}}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache().Visible(kFull, {Query{0, -1, false}}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// The bound Visible hands to its admission check before it lists anything: exact for sequences
// stored without gaps, an upper bound otherwise (seq 2 stores 1, 5, 9).
TEST_F(VisibleTest, AdmitSeesAnUpperBoundOfThePositionsListed) {
  const std::vector<Query> queries = {Query{0, 5, false}, Query{1, 7, false}, Query{2, 6, false},
                                      Query{9, 3, false}};
  int64_t bound = -1;
  absl::StatusOr<Lists> v = cache().Visible(kFull, queries, [&](int64_t b) {
    bound = b;
    return absl::OkStatus();
  });
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, (Lists{Range(0, 6), Range(0, 5), {1, 5}, {}}));
  // 6 + 5 exactly; seq 2 between its stored 1 and 5: at most 5 - 1 + 1 = 5, but it stores 3.
  EXPECT_EQ(bound, 6 + 5 + 3);
  // Sliding (window 3) and chunked (chunk 4) narrow the range before counting.
  v = cache().Visible(kSliding, {Query{0, 5, false}, Query{0, 5, true}}, [&](int64_t b) {
    bound = b;
    return absl::OkStatus();
  });
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(bound, 4 + 8);
  v = cache().Visible(kChunked, {Query{0, 5, false}}, [&](int64_t b) {
    bound = b;
    return absl::OkStatus();
  });
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(bound, 2);
}

TEST_F(VisibleTest, AdmitErrorIsReturnedAsItIs) {
  int calls = 0;
  absl::StatusOr<Lists> v = cache().Visible(kFull, {Query{0, 9, false}}, [&](int64_t b) {
    ++calls;
    return absl::ResourceExhaustedError(absl::StrCat("bound ", b));
  });
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(v.status(), absl::ResourceExhaustedError("bound 10"));
  // Bad requests are refused before admission.
  v = cache().Visible(kFull, {Query{0, -1, false}}, [&](int64_t) {
    ++calls;
    return absl::OkStatus();
  });
  EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(calls, 1);
}

TEST(VisibleBoundTest, RotatingBoundIsExact) {
  // Rotating max_size 4: seq 0 stores 0..9, its ring keeps 6..9.
  const CacheSpec spec = Spec(DType::kF32, 2, 64, 16, {testutil::RotatingGroup(4)});
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  ASSERT_TRUE(AppendRange(*tc.cache, 0, 0, 10).ok());
  for (const Query& q : {Query{0, 9, false}, Query{0, 7, false}, Query{0, 3, true},
                         Query{0, 12, false}, Query{1, 0, false}}) {
    int64_t bound = -1;
    absl::StatusOr<Lists> v = tc.cache->Visible(0, {q}, [&](int64_t b) {
      bound = b;
      return absl::OkStatus();
    });
    ASSERT_TRUE(v.ok()) << v.status();
    EXPECT_EQ(bound, static_cast<int64_t>((*v)[0].size())) << "pos " << q.pos;
  }
}

TEST(VisiblePruneTest, PrunedPositionsAreNotVisible) {
  // window 2, memory 2, one sequence.
  const CacheSpec spec = Spec(DType::kF32, 1, 64, 4, {Group(Full()), Group(Sliding(2))});
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  ASSERT_TRUE(AppendRange(*tc.cache, 0, 0, 4).ok());
  ASSERT_TRUE(AppendRange(*tc.cache, 0, 4, 6).ok());  // sliding drops 0, 1
  absl::StatusOr<Lists> v = tc.cache->Visible(1, {Query{0, 3, true}, Query{0, 5, false}});
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(*v, (Lists{Range(2, 6), Range(3, 6)}));
  v = tc.cache->Visible(0, {Query{0, 3, false}});
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(*v, (Lists{Range(0, 4)}));
}

// ---- VisibleRanges: the same answer as maximal ranges ---------------------------------------

using RangeLists = std::vector<std::vector<PositionRange>>;

// Expands ranges to positions, failing on ranges that are empty, out of order or not maximal.
std::vector<int32_t> Expand(const std::vector<PositionRange>& ranges) {
  std::vector<int32_t> out;
  for (size_t i = 0; i < ranges.size(); ++i) {
    EXPECT_LE(ranges[i].first, ranges[i].last) << "range " << i;
    if (i > 0) {
      EXPECT_GT(int64_t{ranges[i].first}, int64_t{ranges[i - 1].last} + 1)
          << "range " << i << " is not apart from the one before";
    }
    for (int64_t p = ranges[i].first; p <= ranges[i].last; ++p) {
      out.push_back(static_cast<int32_t>(p));
    }
  }
  return out;
}

absl::StatusOr<RangeLists> Ranges(const Cache& cache, int group, const std::vector<Query>& queries,
                                  int64_t* bound) {
  return cache.VisibleRanges(group, queries, [bound](int64_t b) {
    *bound = b;
    return absl::OkStatus();
  });
}

TEST_F(VisibleTest, RangesAnswerWhatPositionsAnswer) {
  std::vector<Query> queries;
  for (int64_t seq : {0, 1, 2, 7}) {
    for (int32_t pos : {0, 1, 2, 3, 4, 5, 6, 9, 10, 100}) {
      queries.push_back(Query{seq, pos, false});
      queries.push_back(Query{seq, pos, true});
    }
  }
  for (int group : {kFull, kSliding, kChunked}) {
    SCOPED_TRACE(absl::StrCat("group ", group));
    int64_t bound = -1;
    absl::StatusOr<RangeLists> ranges = Ranges(cache(), group, queries, &bound);
    ASSERT_TRUE(ranges.ok()) << ranges.status();
    const Lists positions = Visible(group, queries);
    ASSERT_EQ(ranges->size(), queries.size());
    int64_t listed = 0;
    for (size_t i = 0; i < queries.size(); ++i) {
      EXPECT_EQ(Expand((*ranges)[i]), positions[i]) << "query " << i;
      listed += static_cast<int64_t>((*ranges)[i].size());
    }
    EXPECT_GE(bound, listed);
  }
  // Seq 2 stores 1, 5, 9: one range each; seq 0 (0..9) one range whatever the query.
  int64_t bound = -1;
  absl::StatusOr<RangeLists> ranges =
      Ranges(cache(), kFull, {Query{2, 9, false}, Query{0, 9, false}, Query{7, 3, false}}, &bound);
  ASSERT_TRUE(ranges.ok()) << ranges.status();
  EXPECT_EQ(*ranges, (RangeLists{{{1, 1}, {5, 5}, {9, 9}}, {{0, 9}}, {}}));
  EXPECT_EQ(bound, 3 + 1 + 0);  // seq 2 has 3 runs; seq 0 one; seq 7 none
}

// Consecutive positions held in cells that are not consecutive are two runs of the index but
// one range of the answer.
TEST(VisibleRangesTest, ConsecutivePositionsInScatteredCellsAreOneRange) {
  const CacheSpec spec = Spec(DType::kF32, 3, 64, 16, {Group(Full())});
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  ASSERT_TRUE(AppendRange(*tc.cache, 0, 0, 2).ok());
  ASSERT_TRUE(AppendRange(*tc.cache, 1, 0, 2).ok());
  ASSERT_TRUE(AppendRange(*tc.cache, 0, 2, 4).ok());  // cells of seq 1 lie between
  int64_t bound = -1;
  absl::StatusOr<RangeLists> ranges = Ranges(*tc.cache, 0, {Query{0, 3, false}}, &bound);
  ASSERT_TRUE(ranges.ok()) << ranges.status();
  EXPECT_EQ(*ranges, (RangeLists{{{0, 3}}}));
  EXPECT_EQ(bound, 2);  // the index's two runs: the cells really are apart
}

// The highest position a sequence may store is INT32_MAX - 1 (its offset must stay an int32);
// a query may still ask at INT32_MAX.
TEST(VisibleRangesTest, RangesReachTheLastPosition) {
  const CacheSpec spec = Spec(DType::kF32, 1, 64, 16, {Group(Full())});
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  constexpr int32_t kLast = INT32_MAX - 1;
  ASSERT_TRUE(AppendTokens(*tc.cache, {{0, 0}, {0, kLast - 1}, {0, kLast}}).ok());
  int64_t bound = -1;
  absl::StatusOr<RangeLists> ranges =
      Ranges(*tc.cache, 0,
             {Query{0, INT32_MAX, false}, Query{0, 0, true}, Query{0, kLast - 1, false},
              Query{0, 0, false}, Query{0, 1, false}},
             &bound);
  ASSERT_TRUE(ranges.ok()) << ranges.status();
  const std::vector<PositionRange> all = {{0, 0}, {kLast - 1, kLast}};
  EXPECT_EQ(*ranges, (RangeLists{all, all, {{0, 0}, {kLast - 1, kLast - 1}}, {{0, 0}}, {{0, 0}}}));
  EXPECT_GE(bound, 2 + 2 + 2 + 1 + 1);
}

TEST(VisibleRangesTest, RotatingRingIsOneRange) {
  const CacheSpec spec = Spec(DType::kF32, 2, 64, 16, {testutil::RotatingGroup(4)});
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  ASSERT_TRUE(AppendRange(*tc.cache, 0, 0, 10).ok());  // the ring keeps 6..9
  int64_t bound = -1;
  absl::StatusOr<RangeLists> ranges =
      Ranges(*tc.cache, 0, {Query{0, 9, false}, Query{0, 7, false}, Query{1, 0, false}}, &bound);
  ASSERT_TRUE(ranges.ok()) << ranges.status();
  EXPECT_EQ(*ranges, (RangeLists{{{6, 9}}, {{6, 7}}, {}}));
  EXPECT_EQ(bound, 2);  // one range per query that sees the ring
}

TEST_F(VisibleTest, RangesRefuseWhatPositionsRefuseAndReturnAdmitErrors) {
  for (const auto& [group, query] :
       std::vector<std::pair<int, Query>>{{-1, Query{0, 1, false}},
                                          {3, Query{0, 1, false}},
                                          {kFull, Query{-1, 1, false}},
                                          {kFull, Query{0, -1, false}}}) {
    int calls = 0;
    absl::StatusOr<RangeLists> ranges = cache().VisibleRanges(group, {query}, [&](int64_t) {
      ++calls;
      return absl::OkStatus();
    });
    EXPECT_EQ(ranges.status().code(), absl::StatusCode::kInvalidArgument) << group;
    EXPECT_EQ(ranges.status(), cache().Visible(group, {query}).status());
    EXPECT_EQ(calls, 0);
  }
  absl::StatusOr<RangeLists> ranges = cache().VisibleRanges(
      kFull, {Query{0, 9, false}, Query{2, 9, false}},
      [](int64_t b) { return absl::ResourceExhaustedError(absl::StrCat("bound ", b)); });
  EXPECT_EQ(ranges.status(), absl::ResourceExhaustedError("bound 4"));
}

}  // namespace
}  // namespace kvmesh
