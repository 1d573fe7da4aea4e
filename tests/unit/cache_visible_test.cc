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

}  // namespace
}  // namespace kvmesh
