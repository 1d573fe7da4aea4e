// RunIndex (cache/run_index.h): its edges (empty, one position, gaps, runs joined from either
// side, positions at 0 and at INT32_MAX, range bounds outside int32), and a seeded random walk
// checked after every step against a std::map and against the runs the map implies (the index
// must hold exactly its maximal runs, no more entries).
#include "cache/run_index.h"

#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace kvmesh {
namespace {

constexpr int32_t kMax = std::numeric_limits<int32_t>::max();
using Model = std::map<int32_t, int32_t>;
using IndexRun = RunIndex::Run;

std::vector<std::pair<int32_t, int32_t>> Positions(const RunIndex& index) {
  std::vector<std::pair<int32_t, int32_t>> out;
  for (auto it = index.begin(); it != index.end(); ++it) out.emplace_back(it.pos(), it.cell());
  return out;
}

std::vector<std::pair<int32_t, int32_t>> Positions(const Model& model) {
  return {model.begin(), model.end()};
}

std::vector<IndexRun> Runs(const RunIndex& index, int64_t begin = RunIndex::kBegin,
                           int64_t end = RunIndex::kEnd) {
  std::vector<IndexRun> out;
  index.ForEachRun(begin, end, [&out](const IndexRun& run) { out.push_back(run); });
  return out;
}

// The maximal runs of the model's positions in [begin, end).
std::vector<IndexRun> Runs(const Model& model, int64_t begin = RunIndex::kBegin,
                           int64_t end = RunIndex::kEnd) {
  std::vector<IndexRun> out;
  for (const auto& [pos, cell] : model) {
    if (pos < begin || pos >= end) continue;
    if (!out.empty() && int64_t{out.back().pos} + out.back().length == pos &&
        int64_t{out.back().cell} + out.back().length == cell) {
      ++out.back().length;
    } else {
      out.push_back(IndexRun{pos, cell, 1});
    }
  }
  return out;
}

void ExpectSameRuns(const std::vector<IndexRun>& got, const std::vector<IndexRun>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].pos, want[i].pos) << "run " << i;
    EXPECT_EQ(got[i].cell, want[i].cell) << "run " << i;
    EXPECT_EQ(got[i].length, want[i].length) << "run " << i;
  }
}

TEST(RunIndexTest, Empty) {
  RunIndex index;
  EXPECT_TRUE(index.empty());
  EXPECT_EQ(index.size(), 0);
  EXPECT_EQ(index.run_count(), 0u);
  EXPECT_TRUE(index.begin() == index.end());
  EXPECT_TRUE(index.lower_bound(0) == index.end());
  EXPECT_TRUE(index.lower_bound(RunIndex::kBegin) == index.end());
  EXPECT_FALSE(index.contains(0));
  EXPECT_EQ(index.LastAtOrBelow(RunIndex::kEnd), std::nullopt);
  EXPECT_EQ(index.Erase(RunIndex::kBegin, RunIndex::kEnd), 0);
  EXPECT_TRUE(index.Prefix(RunIndex::kEnd).empty());
  EXPECT_TRUE(Runs(index).empty());
}

TEST(RunIndexTest, OnePosition) {
  RunIndex index;
  ASSERT_TRUE(index.Insert(7, 3));
  EXPECT_FALSE(index.Insert(7, 4)) << "a stored position is not stored again";
  EXPECT_EQ(index.size(), 1);
  EXPECT_EQ(index.first(), 7);
  EXPECT_EQ(index.last(), 7);
  EXPECT_EQ(index.Find(7), 3);
  EXPECT_EQ(index.Find(6), std::nullopt);
  EXPECT_EQ(index.Find(8), std::nullopt);
  EXPECT_EQ(index.lower_bound(0).pos(), 7);
  EXPECT_EQ(index.lower_bound(7).cell(), 3);
  EXPECT_TRUE(index.lower_bound(8) == index.end());
  EXPECT_EQ(index.LastAtOrBelow(6), std::nullopt);
  EXPECT_EQ(index.LastAtOrBelow(100), 7);
  EXPECT_TRUE(index.Prefix(7).empty());
  EXPECT_EQ(index.Prefix(8).size(), 1);
  EXPECT_EQ(index.Erase(0, 7), 0);
  EXPECT_EQ(index.Erase(8, 100), 0);
  EXPECT_EQ(index.Erase(7, 8), 1);
  EXPECT_TRUE(index.empty());
}

TEST(RunIndexTest, AppendingInConsecutiveCellsMakesOneRun) {
  RunIndex index;
  for (int32_t i = 0; i < 4096; ++i) ASSERT_TRUE(index.Insert(i, 100 + i));
  EXPECT_EQ(index.size(), 4096);
  EXPECT_EQ(index.run_count(), 1u);
  EXPECT_EQ(index.Prefix(1024).run_count(), 1u);
  EXPECT_EQ(index.Prefix(1024).size(), 1024);
  EXPECT_EQ(index.Prefix(1024).last(), 1023);
  // A cell out of order starts a run; the next position continues the new one.
  ASSERT_TRUE(index.Insert(4096, 0));
  ASSERT_TRUE(index.Insert(4097, 1));
  EXPECT_EQ(index.run_count(), 2u);
}

TEST(RunIndexTest, GapsAndJoiningFromEitherSide) {
  RunIndex index;
  ASSERT_TRUE(index.Insert(10, 10));
  ASSERT_TRUE(index.Insert(12, 12));
  EXPECT_EQ(index.run_count(), 2u);
  ASSERT_TRUE(index.Insert(11, 11));  // bridges both
  EXPECT_EQ(index.run_count(), 1u);
  ASSERT_TRUE(index.Insert(9, 9));  // joins the run after it
  EXPECT_EQ(index.run_count(), 1u);
  EXPECT_EQ(index.first(), 9);
  ASSERT_TRUE(index.Insert(8, 50));  // next position, unrelated cell
  EXPECT_EQ(index.run_count(), 2u);
  // Cutting the middle of a run leaves its head and tail.
  EXPECT_EQ(index.Erase(10, 12), 2);
  ExpectSameRuns(Runs(index), {IndexRun{8, 50, 1}, IndexRun{9, 9, 1}, IndexRun{12, 12, 1}});
  EXPECT_EQ(index.LastAtOrBelow(11), 9);
  EXPECT_EQ(index.lower_bound(10).pos(), 12);
  ExpectSameRuns(Runs(index, 9, 13), {IndexRun{9, 9, 1}, IndexRun{12, 12, 1}});
}

TEST(RunIndexTest, PositionsAtTheTopOfInt32) {
  RunIndex index;
  ASSERT_TRUE(index.Insert(kMax - 2, 0));
  ASSERT_TRUE(index.Insert(kMax - 1, 1));
  ASSERT_TRUE(index.Insert(kMax, 2));
  EXPECT_EQ(index.run_count(), 1u);
  EXPECT_EQ(index.last(), kMax);
  EXPECT_EQ(index.Find(kMax), 2);
  EXPECT_EQ(index.LastAtOrBelow(RunIndex::kEnd), kMax);
  EXPECT_TRUE(index.lower_bound(int64_t{kMax} + 1) == index.end());
  EXPECT_EQ(index.Prefix(kMax).size(), 2);
  EXPECT_EQ(index.Prefix(int64_t{kMax} + 1).size(), 3);
  ExpectSameRuns(Runs(index, kMax, RunIndex::kEnd), {IndexRun{kMax, 2, 1}});
  EXPECT_EQ(index.Erase(int64_t{kMax} + 1, RunIndex::kEnd), 0);
  EXPECT_EQ(index.Erase(kMax, RunIndex::kEnd), 1);
  EXPECT_EQ(index.last(), kMax - 1);
  ASSERT_TRUE(index.Insert(kMax, 2));  // joins again
  EXPECT_EQ(index.run_count(), 1u);
  EXPECT_EQ(index.Erase(RunIndex::kBegin, RunIndex::kEnd), 3);
  EXPECT_TRUE(index.empty());
  // Position 0 and bounds below it.
  ASSERT_TRUE(index.Insert(0, 5));
  EXPECT_EQ(index.Erase(RunIndex::kBegin, 0), 0);
  EXPECT_EQ(index.LastAtOrBelow(-1), std::nullopt);
  EXPECT_EQ(index.lower_bound(RunIndex::kBegin).pos(), 0);
}

// A random walk of inserts (mostly continuing runs, as appends do), erases of ranges, prefix
// copies and lookups, near 0 and near INT32_MAX.
TEST(RunIndexTest, MatchesAnOrderedMap) {
  for (const int64_t base : {int64_t{0}, int64_t{kMax} - 300}) {
    std::mt19937 rng(static_cast<uint32_t>(base + 17));
    auto uniform = [&rng](int64_t lo, int64_t hi) {
      return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
    };
    RunIndex index;
    Model model;
    int32_t next_cell = 0;
    for (int step = 0; step < 20000; ++step) {
      SCOPED_TRACE(testing::Message() << "base " << base << ", step " << step);
      const int64_t op = uniform(0, 99);
      const int32_t pos = static_cast<int32_t>(base + uniform(0, 300));
      if (op < 60) {
        // Usually the cell after the last one given out, sometimes any.
        const int32_t cell =
            uniform(0, 3) == 0 ? static_cast<int32_t>(uniform(0, 1000)) : next_cell++;
        const bool stored = model.count(pos) > 0;
        ASSERT_EQ(index.Insert(pos, cell), !stored);
        if (!stored) model.emplace(pos, cell);
      } else if (op < 80) {
        const int64_t begin = uniform(0, 9) == 0 ? RunIndex::kBegin : pos;
        const int64_t end = uniform(0, 9) == 0 ? RunIndex::kEnd : pos + uniform(-2, 40);
        int64_t removed = 0;
        for (auto it = model.begin(); it != model.end();) {
          if (it->first >= begin && it->first < end) {
            it = model.erase(it);
            ++removed;
          } else {
            ++it;
          }
        }
        ASSERT_EQ(index.Erase(begin, end), removed);
      } else if (op < 83) {
        const int64_t end = uniform(0, 9) == 0 ? RunIndex::kEnd : pos;
        index = index.Prefix(end);
        if (end <= kMax) model.erase(model.lower_bound(static_cast<int32_t>(end)), model.end());
      } else {
        // May lie past INT32_MAX, where the model has nothing.
        const int64_t query = pos + uniform(-3, 3);
        const bool above = query > kMax;
        const int32_t key = above ? kMax : static_cast<int32_t>(query);
        const auto found = above ? model.end() : model.find(key);
        ASSERT_EQ(index.Find(query),
                  found == model.end() ? std::nullopt : std::optional<int32_t>(found->second));
        auto lower = above ? model.end() : model.lower_bound(key);
        auto got = index.lower_bound(query);
        if (lower == model.end()) {
          ASSERT_TRUE(got == index.end());
        } else {
          ASSERT_EQ(got.pos(), lower->first);
          ASSERT_EQ(got.cell(), lower->second);
        }
        auto upper = above ? model.end() : model.upper_bound(key);
        ASSERT_EQ(index.LastAtOrBelow(query),
                  upper == model.begin() ? std::nullopt
                                         : std::optional<int32_t>(std::prev(upper)->first));
        const int64_t end = query + uniform(0, 50);
        ExpectSameRuns(Runs(index, query, end), Runs(model, query, end));
      }
      ASSERT_EQ(index.size(), static_cast<int64_t>(model.size()));
      ASSERT_EQ(index.empty(), model.empty());
      if (!model.empty()) {
        ASSERT_EQ(index.first(), model.begin()->first);
        ASSERT_EQ(index.last(), model.rbegin()->first);
      }
      if (step % 16 == 0) {
        ASSERT_EQ(Positions(index), Positions(model));
        const std::vector<IndexRun> want = Runs(model);
        ASSERT_EQ(index.run_count(), want.size()) << "runs are not maximal";
        ExpectSameRuns(Runs(index), want);
      }
    }
  }
}

}  // namespace
}  // namespace kvmesh
