// Retention and eviction (docs/api.md#eviction): the LRU policy evicts whole sequences, lowest
// priority first and then least recently used, atomically with the Append that needs the room;
// it never evicts a pinned sequence or one in use, and when evicting everything it may would
// not make room it evicts nothing. TTLs expire idle sequences. Every eviction is an event.
#include <atomic>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cache/cache.h"
#include "cache/event_log.h"
#include "cache/shortage.h"
#include "gtest/gtest.h"
#include "tests/unit/cache_test_util.h"

namespace kvmesh {
namespace {

using testutil::AppendPrompt;
using testutil::AppendRange;
using testutil::CaptureState;
using testutil::Full;
using testutil::Group;
using testutil::IsError;
using testutil::SameState;
using testutil::Spec;
using testutil::TestCache;

// 8 sequences x 4 positions of one Attention group: 32 cells, 4 sequences of 8 positions.
CacheSpec LruSpec(EvictionPolicy policy = EvictionPolicy::kLru, int32_t max_sequences = 8) {
  CacheSpec spec = Spec(DType::kF16, max_sequences, 32 / max_sequences, 8, {Group(Full())});
  spec.eviction = policy;
  return spec;
}

std::vector<int64_t> LiveSeqs(const Cache& cache) {
  std::vector<int64_t> seqs;
  for (const SequenceInfo& info : cache.ListSequences()) seqs.push_back(info.seq);
  return seqs;
}

// The payload of `seq`'s positions [0, n) as appended (salt 0).
std::string Expected(const CacheSpec& spec, int64_t seq, int32_t n) {
  return testutil::ReadPayload(spec, {testutil::Ids(seq, testutil::Range(0, n))});
}

// Fills the cache with sequences 1..4 of 8 positions, used in that order (1 least recently).
void FillFour(Cache& cache) {
  for (int64_t seq = 1; seq <= 4; ++seq) {
    ASSERT_TRUE(AppendRange(cache, seq, 0, 8).ok());
    absl::SleepFor(absl::Milliseconds(2));  // distinct last uses
  }
}

TEST(CacheEvictionTest, PolicyNoneRefusesAsBefore) {
  TestCache t(LruSpec(EvictionPolicy::kNone));
  FillFour(*t.cache);
  const testutil::CacheState before = CaptureState(*t.cache);
  const absl::Status status = AppendRange(*t.cache, 5, 0, 8);
  EXPECT_TRUE(IsError(status, absl::StatusCode::kResourceExhausted, {"8", "0"})) << status;
  EXPECT_TRUE(SameState(before, CaptureState(*t.cache)));
  EXPECT_EQ(t.cache->Evictions().lru, 0);
}

TEST(CacheEvictionTest, LruEvictsTheLeastRecentlyUsedWholeSequence) {
  const CacheSpec spec = LruSpec();
  TestCache t(spec);
  EventLog events;
  absl::StatusOr<std::unique_ptr<Cache>> created =
      Cache::Create(spec, t.device.get(), kDefaultTenant, 64, &events);
  ASSERT_TRUE(created.ok()) << created.status();
  t.cache.reset();
  Cache& cache = **created;
  FillFour(cache);
  // A Read is a use: 1 becomes the most recently used, so 2 is the least.
  ASSERT_TRUE(cache.Read(1, 0, std::nullopt).ok());
  const uint64_t from = events.next_number();
  ASSERT_TRUE(AppendRange(cache, 5, 0, 8).ok());
  EXPECT_EQ(LiveSeqs(cache), (std::vector<int64_t>{1, 3, 4, 5}));
  for (int64_t seq : {1, 3, 4, 5}) {
    absl::StatusOr<ReadResult> read = cache.Read(seq, 0, std::nullopt);
    ASSERT_TRUE(read.ok()) << read.status();
    EXPECT_TRUE(testutil::SameBytes(Expected(spec, seq, 8), read->payload)) << "seq " << seq;
  }
  EXPECT_EQ(cache.Evictions().lru, 1);
  absl::StatusOr<std::vector<Event>> published = events.Read(from, 100, 1 << 20);
  ASSERT_TRUE(published.ok());
  std::vector<int64_t> evicted;
  for (const Event& e : *published) {
    if (e.kind != EventKind::kEvicted) continue;
    evicted.push_back(e.seq);
    EXPECT_EQ(e.reason, "lru");
    EXPECT_EQ(e.offset, 8);
  }
  EXPECT_EQ(evicted, (std::vector<int64_t>{2}));
}

TEST(CacheEvictionTest, LowerPriorityGoesFirstAndAsManyAsTheAppendNeeds) {
  const CacheSpec spec = LruSpec();
  TestCache t(spec);
  FillFour(*t.cache);
  // 1 is the least recently used but has priority 1; 3 and 4 stay at 0.
  ASSERT_TRUE(t.cache->SetRetention(1, Retention{1, false, absl::ZeroDuration()}).ok());
  ASSERT_TRUE(t.cache->Read(2, 0, std::nullopt).ok());
  // 12 positions need 12 of the 32 cells, none free: 3 then 4 (priority 0, least recently used
  // first; 2 was used last), 16 cells.
  ASSERT_TRUE(AppendRange(*t.cache, 5, 0, 8).ok());
  ASSERT_TRUE(AppendRange(*t.cache, 6, 0, 4).ok());
  EXPECT_EQ(LiveSeqs(*t.cache), (std::vector<int64_t>{1, 2, 5, 6}));
  EXPECT_EQ(t.cache->Evictions().lru, 2);
}

TEST(CacheEvictionTest, PinnedAndInUseSequencesStayAndARefusalEvictsNothing) {
  const CacheSpec spec = LruSpec();
  auto cache_ptr = std::make_shared<TestCache>(spec);
  Cache& cache = *cache_ptr->cache;
  FillFour(cache);
  // 1: pinned; 2: pending speculative tokens... in a cache without room for them, so a room
  // reservation instead; 3: cells pinned by an open read; 4: refused by the filter.
  ASSERT_TRUE(cache.SetRetention(1, Retention{0, true, absl::ZeroDuration()}).ok());
  ASSERT_TRUE(cache.Reserve(2, 8, absl::Now() + absl::Hours(1)).ok());
  std::shared_ptr<Cache> shared(cache_ptr, cache_ptr->cache.get());
  absl::StatusOr<std::unique_ptr<ReadCursor>> open = Cache::OpenRead(shared, 3, 0, std::nullopt);
  ASSERT_TRUE(open.ok()) << open.status();
  cache.SetEvictionFilter([](int64_t seq) { return seq != 4; });
  const testutil::CacheState before = CaptureState(cache);
  const absl::Status status = AppendRange(cache, 5, 0, 8);
  EXPECT_TRUE(IsError(status, absl::StatusCode::kResourceExhausted, {"would not make room"}))
      << status;
  ASSERT_TRUE(GetShortage(status).has_value()) << "the details survive the longer message";
  EXPECT_EQ(GetShortage(status)->resource, Resource::kCells);
  EXPECT_TRUE(SameState(before, CaptureState(cache)));
  EXPECT_EQ(cache.Evictions().lru, 0);
  // The read closed, 3 may go.
  open->reset();
  ASSERT_TRUE(AppendRange(cache, 5, 0, 8).ok());
  EXPECT_EQ(LiveSeqs(cache), (std::vector<int64_t>{1, 2, 4, 5}));
}

TEST(CacheEvictionTest, SharedCellsCountOnlyWhenEveryHolderGoes) {
  const CacheSpec spec = LruSpec();
  TestCache t(spec);
  Cache& cache = *t.cache;
  // 1 holds 8 cells; 2 and 3 share 1's first 6 and add 2 each; 4 holds 8: 8 + 2 + 2 + 8 = 20.
  ASSERT_TRUE(AppendRange(cache, 1, 0, 8).ok());
  ASSERT_TRUE(cache.CopyPrefix(1, 2, 6).ok());
  ASSERT_TRUE(AppendRange(cache, 2, 6, 8, /*salt=*/2).ok());
  ASSERT_TRUE(cache.CopyPrefix(1, 3, 6).ok());
  ASSERT_TRUE(AppendRange(cache, 3, 6, 8, /*salt=*/3).ok());
  ASSERT_TRUE(AppendRange(cache, 4, 0, 8).ok());
  // Order of last use: 1 (CopyPrefix to 3 was its last use), 2, 3, 4... make it 1, 2, 3, 4.
  absl::SleepFor(absl::Milliseconds(2));
  ASSERT_TRUE(cache.Read(2, 0, std::nullopt).ok());
  absl::SleepFor(absl::Milliseconds(2));
  ASSERT_TRUE(cache.Read(3, 0, std::nullopt).ok());
  absl::SleepFor(absl::Milliseconds(2));
  ASSERT_TRUE(cache.Read(4, 0, std::nullopt).ok());
  // 12 free; 16 positions need 4 more. Evicting 1 frees 2 cells (its last two; its first six
  // are 2's and 3's too), then 2 frees its 2: enough.
  ASSERT_TRUE(AppendRange(cache, 5, 0, 16 / 2).ok());
  ASSERT_TRUE(AppendRange(cache, 5, 8, 16).ok());
  EXPECT_EQ(LiveSeqs(cache), (std::vector<int64_t>{3, 4, 5}));
  absl::StatusOr<ReadResult> read = cache.Read(3, 0, std::nullopt);
  ASSERT_TRUE(read.ok());
  EXPECT_EQ(read->positions[0], testutil::Range(0, 8));
}

// A sequence that only shares cells with one being read may go: its own cells free, the shared
// ones stay with the reader (issue 35's repro, scaled down: a fork of a source whose Read is
// open, then an Append that needs the fork's cells).
TEST(CacheEvictionTest, AForkOfASequenceBeingReadMayGo) {
  const CacheSpec spec = LruSpec();
  auto cache_ptr = std::make_shared<TestCache>(spec);
  Cache& cache = *cache_ptr->cache;
  std::shared_ptr<Cache> shared(cache_ptr, cache_ptr->cache.get());
  // 1 holds 8 cells; its fork 2 shares 4 and adds 4 of its own; 3 holds 8: 20 of 32 used.
  ASSERT_TRUE(AppendRange(cache, 1, 0, 8).ok());
  ASSERT_TRUE(cache.CopyPrefix(1, 2, 4).ok());
  ASSERT_TRUE(AppendRange(cache, 2, 4, 8, /*salt=*/2).ok());
  absl::SleepFor(absl::Milliseconds(2));
  ASSERT_TRUE(AppendRange(cache, 3, 0, 8).ok());
  absl::SleepFor(absl::Milliseconds(2));
  absl::StatusOr<std::unique_ptr<ReadCursor>> open = Cache::OpenRead(shared, 1, 0, std::nullopt);
  ASSERT_TRUE(open.ok()) << open.status();
  // 12 free; 16 more positions of 4 need 4 cells beyond them: the fork's own 4 (1 is being
  // read, 3 was used after 2).
  ASSERT_TRUE(AppendRange(cache, 4, 0, 8).ok());
  const absl::Status status = AppendRange(cache, 4, 8, 16);
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_EQ(LiveSeqs(cache), (std::vector<int64_t>{1, 3, 4}));
  EXPECT_EQ(cache.Evictions().lru, 1);
  // The read sees 1 whole, and 1 is still whole after it.
  std::string bytes((*open)->size(), '\0');
  ASSERT_TRUE(
      (*open)
          ->ReadAt(0, absl::MakeSpan(reinterpret_cast<uint8_t*>(bytes.data()), bytes.size()))
          .ok());
  EXPECT_EQ(bytes, Expected(spec, 1, 8));
  open->reset();
  absl::StatusOr<ReadResult> read = cache.Read(1, 0, std::nullopt);
  ASSERT_TRUE(read.ok());
  EXPECT_EQ(read->payload, Expected(spec, 1, 8));
}

// CopyPrefix and Restore (an import's restore too: a cross-node CopyPrefix or Migrate) make room
// under LRU as an Append does, never evicting their own sequences; without LRU they refuse.
TEST(CacheEvictionTest, CopyPrefixAndRestoreEvictToo) {
  CacheSpec spec = Spec(DType::kF16, 2, 16, 8, {Group(Full())});
  spec.eviction = EvictionPolicy::kLru;
  TestCache t(spec);
  Cache& cache = *t.cache;
  ASSERT_TRUE(AppendRange(cache, 1, 0, 8).ok());
  absl::SleepFor(absl::Milliseconds(2));
  ASSERT_TRUE(AppendRange(cache, 2, 0, 8).ok());
  // A third sequence needs a slot: 1 is the least recently used, but it is the source.
  const absl::Status copied = cache.CopyPrefix(1, 3, 4);
  ASSERT_TRUE(copied.ok()) << copied;
  EXPECT_EQ(LiveSeqs(cache), (std::vector<int64_t>{1, 3}));
  EXPECT_EQ(cache.Evictions().lru, 1);

  // 32 cells, all used by four sequences; a snapshot of 4 restored into a fifth needs 8.
  TestCache u(LruSpec());
  FillFour(*u.cache);
  absl::StatusOr<SnapshotInfo> snap = u.cache->Snapshot(4, 0);
  ASSERT_TRUE(snap.ok()) << snap.status();
  const absl::Status restored = u.cache->Restore(5, snap->id, 8);
  ASSERT_TRUE(restored.ok()) << restored;
  EXPECT_EQ(LiveSeqs(*u.cache), (std::vector<int64_t>{2, 3, 4, 5}));
  absl::StatusOr<ReadResult> read = u.cache->Read(5, 0, std::nullopt);
  ASSERT_TRUE(read.ok());
  EXPECT_EQ(read->payload, Expected(u.cache->spec(), 4, 8));

  // Without LRU: refused, nothing evicted.
  TestCache v(LruSpec(EvictionPolicy::kNone));
  FillFour(*v.cache);
  snap = v.cache->Snapshot(4, 0);
  ASSERT_TRUE(snap.ok()) << snap.status();
  const testutil::CacheState before = CaptureState(*v.cache);
  EXPECT_EQ(v.cache->Restore(5, snap->id, 8).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(SameState(before, CaptureState(*v.cache)));
}

TEST(CacheEvictionTest, SequenceSlotsAreMadeToo) {
  // max_sequences 2, 16 positions each: a third sequence needs a slot, not cells.
  CacheSpec spec = Spec(DType::kF16, 2, 16, 8, {Group(Full())});
  spec.eviction = EvictionPolicy::kLru;
  TestCache t(spec);
  ASSERT_TRUE(AppendRange(*t.cache, 1, 0, 2).ok());
  absl::SleepFor(absl::Milliseconds(2));
  ASSERT_TRUE(AppendRange(*t.cache, 2, 0, 2).ok());
  ASSERT_TRUE(AppendRange(*t.cache, 3, 0, 2).ok());
  EXPECT_EQ(LiveSeqs(*t.cache), (std::vector<int64_t>{2, 3}));
}

TEST(CacheEvictionTest, ContiguousCacheEvictsRingsAndStates) {
  CacheSpec spec =
      Spec(DType::kF16, 2, 8, 4, {testutil::RotatingGroup(4), testutil::RecurrentGroup()});
  spec.eviction = EvictionPolicy::kLru;
  TestCache t(spec);
  ASSERT_TRUE(AppendRange(*t.cache, 1, 0, 3).ok());
  absl::SleepFor(absl::Milliseconds(2));
  ASSERT_TRUE(AppendRange(*t.cache, 2, 0, 3).ok());
  ASSERT_TRUE(AppendRange(*t.cache, 3, 0, 3).ok());
  EXPECT_EQ(LiveSeqs(*t.cache), (std::vector<int64_t>{2, 3}));
  absl::StatusOr<ReadResult> read = t.cache->Read(3, 0, std::nullopt);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->states[1], StateStatus::kValid);
}

TEST(CacheEvictionTest, AnAppendWriterEvictsOnlyWhenItCommits) {
  const CacheSpec spec = LruSpec();
  auto owner = std::make_shared<TestCache>(spec);
  std::shared_ptr<Cache> cache(owner, owner->cache.get());
  FillFour(*cache);
  const std::vector<Token> tokens = testutil::Tokens(5, 0, 8);
  const std::vector<uint8_t> payload = testutil::PayloadFor(spec, tokens);
  {
    // A writer that never commits (a cancelled stream) evicts nothing.
    absl::StatusOr<std::unique_ptr<AppendWriter>> abandoned =
        Cache::BeginAppend(cache, tokens, payload.size());
    ASSERT_TRUE(abandoned.ok()) << abandoned.status();
    EXPECT_FALSE((*abandoned)->in_cells());
    ASSERT_TRUE((*abandoned)->Write(absl::MakeConstSpan(payload).subspan(0, 8)).ok());
  }
  EXPECT_EQ(LiveSeqs(*cache), (std::vector<int64_t>{1, 2, 3, 4}));
  EXPECT_EQ(cache->Evictions().lru, 0);
  absl::StatusOr<std::unique_ptr<AppendWriter>> writer =
      Cache::BeginAppend(cache, tokens, payload.size());
  ASSERT_TRUE(writer.ok()) << writer.status();
  ASSERT_TRUE((*writer)->Write(payload).ok());
  EXPECT_EQ(cache->Evictions().lru, 0);
  ASSERT_TRUE((*writer)->Commit().ok());
  EXPECT_EQ(LiveSeqs(*cache), (std::vector<int64_t>{2, 3, 4, 5}));
  EXPECT_EQ(cache->Evictions().lru, 1);
  // One that could not make room even by evicting is refused at once.
  for (int64_t seq : {2, 3, 4, 5}) {
    ASSERT_TRUE(cache->SetRetention(seq, Retention{0, true, absl::ZeroDuration()}).ok());
  }
  const std::vector<Token> more = testutil::Tokens(6, 0, 8);
  absl::StatusOr<std::unique_ptr<AppendWriter>> refused =
      Cache::BeginAppend(cache, more, payload.size());
  EXPECT_TRUE(
      IsError(refused.status(), absl::StatusCode::kResourceExhausted, {"would not make room"}))
      << refused.status();
}

TEST(CacheEvictionTest, SlidingWindowCachesEvictWholeSequencesToo) {
  // Sliding window 4 (memory 4), 3 sequences, batches of 8: 3 x 4 + 8 = 20 cells.
  CacheSpec spec = Spec(DType::kF16, 3, 64, 8, {Group(testutil::Sliding(4))});
  spec.eviction = EvictionPolicy::kLru;
  TestCache t(spec);
  for (int64_t seq = 1; seq <= 3; ++seq) {
    ASSERT_TRUE(AppendRange(*t.cache, seq, 0, 6).ok());
    absl::SleepFor(absl::Milliseconds(2));
  }
  ASSERT_TRUE(AppendRange(*t.cache, 4, 0, 8).ok());
  EXPECT_EQ(LiveSeqs(*t.cache), (std::vector<int64_t>{2, 3, 4}));
  absl::StatusOr<ReadResult> read = t.cache->Read(4, 0, std::nullopt);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->positions[0], testutil::Range(0, 8));
}

TEST(CacheEvictionTest, TtlExpiresIdleSequencesPinnedOrNot) {
  TestCache t(LruSpec(EvictionPolicy::kNone));
  Cache& cache = *t.cache;
  FillFour(cache);
  ASSERT_TRUE(cache.SetRetention(1, Retention{0, false, absl::Seconds(10)}).ok());
  ASSERT_TRUE(cache.SetRetention(2, Retention{0, true, absl::Seconds(10)}).ok());
  ASSERT_TRUE(cache.SetRetention(3, Retention{0, false, absl::Seconds(30)}).ok());
  const absl::Time now = absl::Now();
  EXPECT_TRUE(cache.ExpireIdle(now).empty());
  EXPECT_EQ(cache.ExpireIdle(now + absl::Seconds(20)), (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(LiveSeqs(cache), (std::vector<int64_t>{3, 4}));
  EXPECT_EQ(cache.Evictions().ttl, 2);
  // A use restarts the clock.
  absl::SleepFor(absl::Milliseconds(5));
  ASSERT_TRUE(cache.CanResume(3, 8).ok());
  const absl::Time used = absl::Now();
  EXPECT_TRUE(cache.ExpireIdle(used + absl::Seconds(29)).empty());
  // In use: a room reservation holds it past its TTL; the next sweep after it ends takes it.
  ASSERT_TRUE(cache.Reserve(3, 16, used + absl::Seconds(40)).ok());
  EXPECT_TRUE(cache.ExpireIdle(used + absl::Seconds(31)).empty());
  EXPECT_EQ(cache.ExpireIdle(used + absl::Seconds(41)), (std::vector<int64_t>{3}));
}

TEST(CacheEvictionTest, RetentionIsTheLiveSequencesOwnAndChecked) {
  TestCache t(LruSpec());
  Cache& cache = *t.cache;
  EXPECT_TRUE(IsError(cache.SetRetention(7, Retention{}), absl::StatusCode::kNotFound, {"7"}));
  ASSERT_TRUE(AppendRange(cache, 7, 0, 4).ok());
  EXPECT_TRUE(IsError(cache.SetRetention(7, Retention{0, false, absl::Seconds(-1)}),
                      absl::StatusCode::kInvalidArgument, {"-1s"}));
  EXPECT_TRUE(
      IsError(cache.SetRetention(-1, Retention{}), absl::StatusCode::kInvalidArgument, {"-1"}));
  ASSERT_TRUE(cache.SetRetention(7, Retention{5, true, absl::Seconds(3)}).ok());
  std::optional<SequenceInfo> info = cache.GetSequence(7);
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->priority, 5);
  EXPECT_TRUE(info->pinned);
  EXPECT_EQ(info->ttl, absl::Seconds(3));
  EXPECT_GT(info->last_used, absl::Now() - absl::Minutes(1));
  // Gone with the sequence: a new sequence 7 starts with the default.
  ASSERT_TRUE(cache.Remove(7, 0, std::nullopt).ok());
  ASSERT_TRUE(AppendRange(cache, 7, 0, 4).ok());
  info = cache.GetSequence(7);
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->priority, 0);
  EXPECT_FALSE(info->pinned);
  EXPECT_EQ(info->ttl, absl::ZeroDuration());
}

// A Restore may set the sequence's retention in the same step (a migrated sequence takes its
// source's): the restored sequence is pinned before any Append can look for a victim, a
// default retention clears what the destination had, and a bad one changes nothing.
TEST(CacheEvictionTest, RestoreSetsTheRetentionWithTheData) {
  TestCache t(LruSpec());
  Cache& cache = *t.cache;
  FillFour(cache);
  absl::StatusOr<SnapshotInfo> snap = cache.Snapshot(4, 0);
  ASSERT_TRUE(snap.ok()) << snap.status();
  ASSERT_TRUE(cache.Remove(4, 0, std::nullopt).ok());
  ASSERT_TRUE(cache.SetRetention(1, Retention{3, false, absl::ZeroDuration()}).ok());
  const testutil::CacheState before = CaptureState(cache);
  RestoreOptions bad;
  bad.retention = Retention{0, true, absl::Milliseconds(-5)};
  EXPECT_TRUE(
      IsError(cache.Restore(4, snap->id, 8, bad), absl::StatusCode::kInvalidArgument, {"-5ms"}));
  EXPECT_TRUE(SameState(before, CaptureState(cache)));
  // 4 comes back pinned, with a TTL. Once 2 and 3 are used after it, 4 is the least recently
  // used of priority 0 (1 has priority 3): the next Append evicts 2 instead.
  RestoreOptions pinned;
  pinned.retention = Retention{0, true, absl::Hours(1)};
  ASSERT_TRUE(cache.Restore(4, snap->id, 8, pinned).ok());
  std::optional<SequenceInfo> info = cache.GetSequence(4);
  ASSERT_TRUE(info.has_value());
  EXPECT_TRUE(info->pinned);
  EXPECT_EQ(info->ttl, absl::Hours(1));
  for (int64_t seq : {2, 3}) {
    absl::SleepFor(absl::Milliseconds(2));
    ASSERT_TRUE(cache.Read(seq, 0, std::nullopt).ok());
  }
  ASSERT_TRUE(AppendRange(cache, 5, 0, 8).ok());
  EXPECT_EQ(LiveSeqs(cache), (std::vector<int64_t>{1, 3, 4, 5}));
  // Restoring over 1 with the default retention clears its priority; without one, 3 keeps its.
  ASSERT_TRUE(cache.SetRetention(3, Retention{2, false, absl::ZeroDuration()}).ok());
  RestoreOptions plain;
  plain.retention = Retention{};
  ASSERT_TRUE(cache.Restore(1, snap->id, 8, plain).ok());
  ASSERT_TRUE(cache.Restore(3, snap->id, 8).ok());
  EXPECT_EQ(cache.GetSequence(1)->priority, 0);
  EXPECT_EQ(cache.GetSequence(3)->priority, 2);
}

TEST(CacheEvictionTest, EvictedChainsLeaveTheBlockIndex) {
  CacheSpec spec = LruSpec();
  spec.token_block_size = 4;
  TestCache t(spec);
  std::vector<int32_t> prompt = testutil::Range(100, 108);
  ASSERT_TRUE(AppendPrompt(*t.cache, 1, 0, 8, prompt).ok());
  absl::SleepFor(absl::Milliseconds(2));
  for (int64_t seq = 2; seq <= 4; ++seq) ASSERT_TRUE(AppendRange(*t.cache, seq, 0, 8).ok());
  ASSERT_EQ(t.cache->LookupPrefix(prompt, 4)->size(), 1u);
  ASSERT_TRUE(AppendRange(*t.cache, 5, 0, 8).ok());
  EXPECT_TRUE(t.cache->LookupPrefix(prompt, 4)->empty());
  EXPECT_EQ(t.cache->TokenIndex().entries, 0u);
}

TEST(CacheEvictionTest, ConcurrentAppendsEvictWhileReadersSeeWholeSequencesOrNone) {
  // 16 sequences of 8 positions fill the cache; sequence 0 is pinned.
  CacheSpec spec = Spec(DType::kF16, 16, 8, 8, {Group(Full())});
  spec.eviction = EvictionPolicy::kLru;
  TestCache t(spec);
  Cache& cache = *t.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 8).ok());
  ASSERT_TRUE(cache.SetRetention(0, Retention{0, true, absl::ZeroDuration()}).ok());
  constexpr int kWriters = 4;
  constexpr int kPerWriter = 60;
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int w = 0; w < kWriters; ++w) {
    threads.emplace_back([&, w] {
      for (int i = 0; i < kPerWriter; ++i) {
        const absl::Status status = AppendRange(cache, 1000 * (w + 1) + i, 0, 8);
        if (!status.ok()) {
          ADD_FAILURE() << "writer " << w << " append " << i << ": " << status;
          ++failures;
        }
      }
    });
  }
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      for (int i = 0; i < 400; ++i) {
        const int64_t seq = 1000 * (1 + (i + r) % kWriters) + (i / kWriters) % kPerWriter;
        absl::StatusOr<ReadResult> read = cache.Read(seq, 0, std::nullopt);
        if (read.ok()) {
          if (read->positions[0] != testutil::Range(0, 8) ||
              read->payload != Expected(spec, seq, 8)) {
            ADD_FAILURE() << "seq " << seq << " read back partial or wrong";
            ++failures;
          }
        } else if (read.status().code() != absl::StatusCode::kNotFound) {
          ADD_FAILURE() << "seq " << seq << ": " << read.status();
          ++failures;
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(cache.ListSequences().size(), 16u);
  EXPECT_EQ(cache.Evictions().lru, kWriters * kPerWriter + 1 - 16);
  absl::StatusOr<ReadResult> pinned = cache.Read(0, 0, std::nullopt);
  ASSERT_TRUE(pinned.ok()) << pinned.status();
  EXPECT_EQ(pinned->payload, Expected(spec, 0, 8));
}

}  // namespace
}  // namespace kvmesh
