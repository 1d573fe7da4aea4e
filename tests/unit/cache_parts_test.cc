// The Cache's parts on their own (cache/cache.h, "Where things live"): the RetentionIndex's
// order of eviction and TTL expiry, the PrefixIndex's changes of block hashes and lookup, and
// the SnapshotStore's ids. Through the Cache they are tested by every cache_*_test.
#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "cache/device/host_device.h"
#include "cache/layer_group.h"
#include "cache/prefix_index.h"
#include "cache/retention_index.h"
#include "cache/snapshot_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvmesh {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;
using ::testing::Pair;

const absl::Time kT0 = absl::FromUnixSeconds(1000);

std::vector<int64_t> Order(const RetentionIndex& index) {
  std::vector<int64_t> order;
  RetentionIndex::Candidates candidates(&index);
  while (const std::optional<int64_t> seq = candidates.Next()) order.push_back(*seq);
  return order;
}

void Use(const RetentionIndex& index, int64_t seq, absl::Time at) {
  RetentionIndex::Uses uses(&index, at);
  uses.Record(seq);
}

TEST(RetentionIndexTest, EvictsLowerPriorityFirstThenLeastRecentlyUsedThenLowerId) {
  RetentionIndex index;
  Use(index, 5, kT0 + absl::Seconds(3));
  Use(index, 2, kT0 + absl::Seconds(1));
  Use(index, 9, kT0 + absl::Seconds(1));
  index.Set(7, Retention{/*priority=*/-1, false, absl::ZeroDuration()});
  Use(index, 7, kT0 + absl::Seconds(9));
  index.Set(1, Retention{/*priority=*/4, false, absl::ZeroDuration()});
  Use(index, 1, kT0);
  EXPECT_THAT(Order(index), ElementsAre(7, 2, 9, 5, 1));
  // A new use moves a sequence back; its last use is the latest.
  Use(index, 2, kT0 + absl::Seconds(5));
  EXPECT_THAT(Order(index), ElementsAre(7, 9, 5, 2, 1));
  EXPECT_EQ(index.LastUse(2), kT0 + absl::Seconds(5));
  EXPECT_EQ(index.LastUse(3), std::nullopt);
}

TEST(RetentionIndexTest, APinnedSequenceIsNoCandidateAndAForgottenOneIsGone) {
  RetentionIndex index;
  Use(index, 1, kT0);
  Use(index, 2, kT0);
  index.Set(1, Retention{0, /*pinned=*/true, absl::ZeroDuration()});
  // The pin takes effect with the use that follows (an operation that sets one records one).
  EXPECT_THAT(Order(index), ElementsAre(1, 2));
  Use(index, 1, kT0 + absl::Seconds(1));
  EXPECT_THAT(Order(index), ElementsAre(2));
  EXPECT_TRUE(index.Get(1).pinned);
  // Back to the default retention: nothing is kept for it, and it is a candidate again.
  index.Set(1, Retention{});
  Use(index, 1, kT0 + absl::Seconds(2));
  EXPECT_THAT(Order(index), ElementsAre(2, 1));
  index.Forget(2);
  EXPECT_THAT(Order(index), ElementsAre(1));
  EXPECT_EQ(index.LastUse(2), std::nullopt);
  index.Forget(1);
  index.Forget(1);  // twice: nothing to forget
  EXPECT_THAT(Order(index), IsEmpty());
}

TEST(RetentionIndexTest, ExpiredAreThoseUnusedForTheirTtlPinnedOrNot) {
  RetentionIndex index;
  index.Set(3, Retention{0, /*pinned=*/true, absl::Seconds(10)});
  index.Set(1, Retention{0, false, absl::Seconds(5)});
  index.Set(2, Retention{0, false, absl::Seconds(20)});
  index.Set(4, Retention{/*priority=*/2, false, absl::ZeroDuration()});  // no TTL
  for (int64_t seq : {1, 2, 3, 4}) Use(index, seq, kT0);
  EXPECT_THAT(index.Expired(kT0 + absl::Seconds(4)), IsEmpty());
  EXPECT_THAT(index.Expired(kT0 + absl::Seconds(5)), ElementsAre(1));
  EXPECT_THAT(index.Expired(kT0 + absl::Seconds(10)), ElementsAre(1, 3));
  Use(index, 1, kT0 + absl::Seconds(9));
  EXPECT_THAT(index.Expired(kT0 + absl::Seconds(60)), ElementsAre(1, 2, 3));
  EXPECT_THAT(index.Expired(kT0 + absl::Seconds(13)), ElementsAre(3));
  // A TTL with no use recorded runs from the beginning of time.
  index.Set(8, Retention{0, false, absl::Seconds(1)});
  EXPECT_THAT(index.Expired(kT0), ElementsAre(8));
}

TEST(RetentionIndexTest, ValidateNamesANegativeTtl) {
  EXPECT_TRUE(RetentionIndex::Validate(Retention{}).ok());
  const absl::Status status = RetentionIndex::Validate(Retention{0, false, absl::Seconds(-3)});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(status.message(), "ttl -3s is negative");
}

TokenHasher Hasher() {
  TokenHasher h;
  h.seed = TokenHashSeed("default", "m");
  h.block_size = 4;
  return h;
}

std::vector<Token> Tokens(int64_t seq, const std::vector<int32_t>& ids, int32_t first = 0) {
  std::vector<Token> tokens;
  for (size_t i = 0; i < ids.size(); ++i) {
    tokens.push_back({seq, first + static_cast<int32_t>(i), ids[i]});
  }
  return tokens;
}

TEST(PrefixIndexTest, ChangesOfBlockHashesAreWhatAWatcherNeedsToMirrorTheIndex) {
  PrefixIndex index(Hasher(), /*token_limit=*/1000);
  const std::vector<int32_t> ids = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  index.RecordAppend(Tokens(0, ids), false);
  std::optional<PrefixIndex::BlocksChange> change = index.Sync(0, true, 10);
  ASSERT_TRUE(change.has_value());
  EXPECT_EQ(change->kept, 0);
  ASSERT_EQ(change->added.size(), 2u);
  const std::vector<uint64_t> blocks = change->added;
  EXPECT_EQ(index.Find(0)->hashes(), blocks);
  // Nothing changed: no change.
  EXPECT_FALSE(index.Sync(0, true, 10).has_value());
  // Cut to 6 positions: the first block stays.
  change = index.Sync(0, true, 6);
  ASSERT_TRUE(change.has_value());
  EXPECT_EQ(change->kept, 1);
  EXPECT_THAT(change->added, IsEmpty());
  // A copy of it elsewhere: all its hashes, as added.
  change = index.Set(3, index.Find(0)->CopyPrefix(6));
  ASSERT_TRUE(change.has_value());
  EXPECT_EQ(change->kept, 0);
  EXPECT_THAT(change->added, ElementsAre(blocks[0]));
  EXPECT_EQ(index.Stats().sequences, 2u);
  EXPECT_EQ(index.Stats().hashes, 1u);
  EXPECT_EQ(index.Stats().entries, 2u);
  // A sequence that stores nothing loses its chain: one change, no hash kept.
  change = index.Sync(3, false, 0);
  ASSERT_TRUE(change.has_value());
  EXPECT_EQ(change->kept, 0);
  EXPECT_THAT(change->added, IsEmpty());
  EXPECT_EQ(index.Find(3), nullptr);
  EXPECT_FALSE(index.Drop(3).has_value());
  // A chain without whole blocks changes no block when it goes.
  index.RecordAppend(Tokens(4, {1, 2}), false);
  EXPECT_FALSE(index.Sync(4, true, 2).has_value());
  EXPECT_FALSE(index.Drop(4).has_value());
  // Ids that do not start at position 0 start no chain.
  index.RecordAppend(Tokens(5, {1, 2, 3, 4}, /*first=*/4), false);
  EXPECT_EQ(index.Find(5), nullptr);
  std::vector<int64_t> with_blocks;
  index.ForEachWithBlocks([&](int64_t seq, const TokenChain&) { with_blocks.push_back(seq); });
  EXPECT_THAT(with_blocks, ElementsAre(0));
}

TEST(PrefixIndexTest, LookupFindsTheLongestCommonPrefixesLongestFirst) {
  const TokenHasher hasher = Hasher();
  PrefixIndex index(hasher, /*token_limit=*/1000);
  const std::vector<int32_t> prompt = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  std::vector<int32_t> a = prompt;
  a[10] = 99;  // shares 10
  std::vector<int32_t> b = prompt;
  b[5] = 99;  // shares 5
  std::vector<int32_t> c = prompt;
  c[2] = 99;  // shares 2: less than a block, no match
  const std::vector<int32_t> d = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};  // shares 10
  int64_t seq = 0;
  for (const std::vector<int32_t>* ids : std::vector<const std::vector<int32_t>*>{&a, &b, &c, &d}) {
    index.RecordAppend(Tokens(seq, *ids), false);
    index.Sync(seq, true, static_cast<int32_t>(ids->size()));
    ++seq;
  }
  absl::StatusOr<std::vector<uint64_t>> hashes = PrefixIndex::PromptHashes(hasher, 1000, prompt);
  ASSERT_TRUE(hashes.ok()) << hashes.status();
  EXPECT_EQ(hashes->size(), 3u);
  EXPECT_THAT(index.Lookup(prompt, *hashes, 4), ElementsAre(Pair(0, 10), Pair(3, 10), Pair(1, 5)));
  EXPECT_THAT(index.Lookup(prompt, *hashes, 1), ElementsAre(Pair(0, 10)));
  // The token limit cuts the prompt, and the hashes with it.
  hashes = PrefixIndex::PromptHashes(hasher, 5, prompt);
  ASSERT_TRUE(hashes.ok());
  EXPECT_EQ(hashes->size(), 1u);
  const absl::StatusOr<std::vector<uint64_t>> bad =
      PrefixIndex::PromptHashes(hasher, 1000, {1, 2, -7});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.status().message(), "tokens[2] = -7 is negative");
}

TEST(SnapshotStoreTest, IdsRiseAndAreNeverReusedAndChunksCountOnce) {
  HostDevice device(1 << 20);
  SnapshotStore store;
  absl::StatusOr<std::shared_ptr<RowChunk>> chunk =
      AllocateChunk(&device, MemoryPool::kSnapshot, nullptr, {64}, 4);
  ASSERT_TRUE(chunk.ok()) << chunk.status();
  auto record = [&](int64_t seq) {
    SnapshotRecord r;
    r.seq = seq;
    r.groups.resize(1);
    r.groups[0].segments.push_back(Segment{*chunk, 0, 1, {0}, {}});
    return r;
  };
  EXPECT_EQ(store.Add(record(10)).id, 1u);
  EXPECT_EQ(store.Add(record(11)).id, 2u);
  EXPECT_EQ(store.Add(record(12)).id, 3u);
  // Three records on one chunk of 4 rows of 64 bytes.
  EXPECT_EQ(store.ChunkBytes(), (*chunk)->arena.size());
  std::unique_ptr<SnapshotRecord> taken = store.Take(2);
  ASSERT_NE(taken, nullptr);
  EXPECT_EQ(taken->seq, 11);
  EXPECT_EQ(store.Take(2), nullptr);
  EXPECT_EQ(store.Find(2), nullptr);
  EXPECT_EQ(store.Add(record(13)).id, 4u);
  std::vector<uint64_t> from2;
  store.ForEachFrom(2, [&](const SnapshotRecord& r) {
    from2.push_back(r.id);
    return true;
  });
  EXPECT_THAT(from2, ElementsAre(3, 4));
  std::vector<uint64_t> first;
  store.ForEachFrom(0, [&](const SnapshotRecord& r) {
    first.push_back(r.id);
    return false;
  });
  EXPECT_THAT(first, ElementsAre(1));
  EXPECT_EQ(store.size(), 3u);
  EXPECT_EQ(store.Find(4)->seq, 13);
  taken.reset();
  store.Take(1);
  store.Take(3);
  store.Take(4);
  EXPECT_EQ(store.ChunkBytes(), 0u);
}

}  // namespace
}  // namespace kvmesh
