// Token ids in the cache: what Append records, and how CopyPrefix, Remove, CommitSpeculation,
// snapshots (Restore, Merge, Split) and wire images keep each sequence's chain in line with
// what it stores (docs/api.md#tokens).
#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "cache/cache.h"
#include "cache/snapshot_wire.h"
#include "gtest/gtest.h"
#include "tests/unit/cache_test_util.h"

namespace kvmesh {
namespace {

using testutil::AppendPrompt;
using testutil::AppendRange;
using testutil::AppendTokens;
using testutil::CacheState;
using testutil::CaptureState;
using testutil::FindSequence;
using testutil::Full;
using testutil::Group;
using testutil::IsError;
using testutil::PayloadFor;
using testutil::RecurrentGroup;
using testutil::Rope;
using testutil::SameState;
using testutil::Sliding;
using testutil::Spec;
using testutil::TestCache;
using testutil::Tokens;

// Blocks of 4 tokens, so that short prompts have several.
CacheSpec FullSpec() {
  CacheSpec spec =
      Spec(DType::kF16, 4, 64, 32, {Group(Full(), 1, 1, 4, 4, Rope(RopeType::kNormal, 4))});
  spec.token_block_size = 4;
  return spec;
}

std::vector<int32_t> Prompt(int32_t n, int32_t base = 100) {
  std::vector<int32_t> p;
  for (int32_t i = 0; i < n; ++i) p.push_back(base + i);
  return p;
}

std::vector<int32_t> Slice(const std::vector<int32_t>& v, size_t begin, size_t end) {
  return std::vector<int32_t>(v.begin() + begin, v.begin() + end);
}

TEST(CacheTokensTest, AppendRecordsIdsAndEqualPromptsHashAlike) {
  TestCache tc(FullSpec());
  Cache& cache = *tc.cache;
  const std::vector<int32_t> prompt = Prompt(10);
  ASSERT_TRUE(AppendPrompt(cache, 0, 0, 6, prompt).ok());
  ASSERT_TRUE(AppendPrompt(cache, 0, 6, 10, prompt).ok());
  ASSERT_TRUE(AppendPrompt(cache, 1, 0, 10, prompt).ok());
  const TokenChain a = cache.Tokens(0);
  EXPECT_EQ(a.ids(), prompt);
  EXPECT_EQ(a.exact(), 10);
  ASSERT_EQ(a.hashes().size(), 2u);
  EXPECT_EQ(cache.Tokens(1).hashes(), a.hashes());  // appended in other pieces: same chain
  const std::optional<SequenceInfo> info = FindSequence(cache, 0);
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->tokens, 10);
  EXPECT_EQ(info->exact_tokens, 10);
  EXPECT_EQ(info->token_blocks, 2);
  // Another tenant's cache of the same name hashes the same prompt differently.
  absl::StatusOr<std::unique_ptr<Cache>> other = Cache::Create(FullSpec(), tc.device.get(), "t2");
  ASSERT_TRUE(other.ok()) << other.status();
  ASSERT_TRUE(AppendPrompt(**other, 0, 0, 10, prompt).ok());
  EXPECT_NE((*other)->Tokens(0).hashes(), a.hashes());
  // A sequence appended without ids has no chain.
  ASSERT_TRUE(AppendRange(cache, 2, 0, 8).ok());
  EXPECT_TRUE(cache.Tokens(2).empty());
  EXPECT_EQ(FindSequence(cache, 2)->tokens, 0);
}

TEST(CacheTokensTest, ANegativeIdIsRefusedAndChangesNothing) {
  TestCache tc(FullSpec());
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendPrompt(cache, 0, 0, 4, Prompt(4)).ok());
  const CacheState before = CaptureState(cache);
  std::vector<Token> tokens = Tokens(0, 4, 6);
  tokens[1].id = -7;
  EXPECT_TRUE(IsError(AppendTokens(cache, tokens), absl::StatusCode::kInvalidArgument,
                      {"tokens[1].token_id", "-7"}));
  EXPECT_TRUE(SameState(before, CaptureState(cache)));
}

TEST(CacheTokensTest, AnAppendWithoutIdsEndsTheChainUntilARemoveCutsBack) {
  TestCache tc(FullSpec());
  Cache& cache = *tc.cache;
  const std::vector<int32_t> prompt = Prompt(12);
  ASSERT_TRUE(AppendPrompt(cache, 0, 0, 5, prompt).ok());
  ASSERT_TRUE(AppendRange(cache, 0, 5, 7).ok());  // no ids
  ASSERT_TRUE(AppendPrompt(cache, 0, 7, 12, prompt).ok());
  EXPECT_EQ(cache.Tokens(0).ids(), Slice(prompt, 0, 5));
  ASSERT_TRUE(cache.Remove(0, 5, std::nullopt).ok());
  ASSERT_TRUE(AppendPrompt(cache, 0, 5, 12, prompt).ok());
  EXPECT_EQ(cache.Tokens(0).ids(), prompt);
  EXPECT_EQ(cache.Tokens(0).exact(), 12);
}

TEST(CacheTokensTest, RemoveWithAShiftMovesIdsAndEndsTheExactPrefix) {
  TestCache tc(FullSpec());
  Cache& cache = *tc.cache;
  const std::vector<int32_t> prompt = Prompt(12);
  ASSERT_TRUE(AppendPrompt(cache, 0, 0, 12, prompt).ok());
  ASSERT_TRUE(cache.Remove(0, 6, 9).ok());  // 9..11 move down to 6..8
  TokenChain chain = cache.Tokens(0);
  std::vector<int32_t> expected = Slice(prompt, 0, 6);
  expected.insert(expected.end(), prompt.begin() + 9, prompt.end());
  EXPECT_EQ(chain.ids(), expected);
  EXPECT_EQ(chain.taint(), 6);
  EXPECT_EQ(chain.exact(), 6);
  EXPECT_EQ(chain.hashes().size(), 1u);  // [0, 4) only
  // Removing everything from the taint on makes the rest exact again.
  ASSERT_TRUE(cache.Remove(0, 5, std::nullopt).ok());
  EXPECT_EQ(cache.Tokens(0).exact(), 5);
  // Removing everything drops the chain.
  ASSERT_TRUE(cache.Remove(0, 0, std::nullopt).ok());
  EXPECT_TRUE(cache.Tokens(0).empty());
  // Removing a range that nothing follows moves nothing: no taint.
  ASSERT_TRUE(AppendPrompt(cache, 0, 0, 12, prompt).ok());
  ASSERT_TRUE(cache.Remove(0, 8, 20).ok());
  EXPECT_EQ(cache.Tokens(0).taint(), kNoTaint);
  EXPECT_EQ(cache.Tokens(0).exact(), 8);
}

TEST(CacheTokensTest, CopyPrefixGivesTheDestinationTheSourcesPrefix) {
  TestCache tc(FullSpec());
  Cache& cache = *tc.cache;
  const std::vector<int32_t> prompt = Prompt(12);
  ASSERT_TRUE(AppendPrompt(cache, 0, 0, 12, prompt).ok());
  ASSERT_TRUE(AppendPrompt(cache, 1, 0, 3, Prompt(3, 7)).ok());
  ASSERT_TRUE(cache.CopyPrefix(0, 1, 9).ok());
  const TokenChain copy = cache.Tokens(1);
  EXPECT_EQ(copy.ids(), Slice(prompt, 0, 9));
  ASSERT_EQ(copy.hashes().size(), 2u);
  EXPECT_EQ(copy.hashes()[1], cache.Tokens(0).hashes()[1]);
  // The copy continues like the source: same ids, same hashes.
  ASSERT_TRUE(AppendPrompt(cache, 1, 9, 12, prompt).ok());
  EXPECT_EQ(cache.Tokens(1).hashes(), cache.Tokens(0).hashes());
  // From a source without ids the destination has none either.
  ASSERT_TRUE(AppendRange(cache, 2, 0, 4).ok());
  ASSERT_TRUE(cache.CopyPrefix(2, 1, 4).ok());
  EXPECT_TRUE(cache.Tokens(1).empty());
  // Length 0 empties the destination, chain included.
  ASSERT_TRUE(cache.CopyPrefix(0, 1, 8).ok());
  ASSERT_TRUE(cache.CopyPrefix(0, 1, 0).ok());
  EXPECT_TRUE(cache.Tokens(1).empty());
}

TEST(CacheTokensTest, SpeculativeIdsCountOnceCommitted) {
  TestCache tc(FullSpec());
  Cache& cache = *tc.cache;
  const std::vector<int32_t> prompt = Prompt(10);
  ASSERT_TRUE(AppendPrompt(cache, 0, 0, 4, prompt).ok());
  std::vector<Token> draft = Tokens(0, 4, 9);
  for (Token& t : draft) t.id = prompt[static_cast<size_t>(t.pos)];
  ASSERT_TRUE(cache.Append(draft, PayloadFor(cache.spec(), draft, 0, true), true).ok());
  EXPECT_EQ(cache.Tokens(0).ids().size(), 9u);
  EXPECT_EQ(cache.Tokens(0).exact(), 4);
  EXPECT_EQ(FindSequence(cache, 0)->exact_tokens, 4);
  ASSERT_TRUE(cache.CommitSpeculation(0, 3).ok());  // 4, 5, 6 accepted
  EXPECT_EQ(cache.Tokens(0).ids(), Slice(prompt, 0, 7));
  EXPECT_EQ(cache.Tokens(0).exact(), 7);
  EXPECT_EQ(cache.Tokens(0).hashes().size(), 1u);
  // None accepted: the chain ends where the draft began.
  ASSERT_TRUE(
      cache.Append(Tokens(0, 7, 8), PayloadFor(cache.spec(), Tokens(0, 7, 8), 0, true), true).ok());
  ASSERT_TRUE(cache.CommitSpeculation(0, 0).ok());
  EXPECT_EQ(cache.Tokens(0).ids().size(), 7u);
}

TEST(CacheTokensTest, RestoreContinuesTheChainOnlyAfterTheSamePrefix) {
  TestCache tc(FullSpec());
  Cache& cache = *tc.cache;
  const std::vector<int32_t> prompt = Prompt(12);
  ASSERT_TRUE(AppendPrompt(cache, 0, 0, 12, prompt).ok());
  absl::StatusOr<SnapshotInfo> whole = cache.Snapshot(0, 0);
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_EQ(whole->tokens, 12);
  // Into a new sequence: the whole chain, clamped to the target.
  ASSERT_TRUE(cache.Restore(1, whole->id, 10).ok());
  EXPECT_EQ(cache.Tokens(1).ids(), Slice(prompt, 0, 10));
  EXPECT_EQ(cache.Tokens(1).exact(), 10);
  const std::vector<uint64_t> source = cache.Tokens(0).hashes();
  EXPECT_EQ(cache.Tokens(1).hashes(), std::vector<uint64_t>(source.begin(), source.begin() + 2));
  // A snapshot from 6, restored after the same six ids: exact throughout.
  absl::StatusOr<SnapshotInfo> tail = cache.Snapshot(0, 6);
  ASSERT_TRUE(tail.ok()) << tail.status();
  ASSERT_TRUE(AppendPrompt(cache, 2, 0, 6, prompt).ok());
  ASSERT_TRUE(cache.Restore(2, tail->id, 12).ok());
  EXPECT_EQ(cache.Tokens(2).ids(), prompt);
  EXPECT_EQ(cache.Tokens(2).exact(), 12);
  // After six other ids, the data from 6 on was computed after a different prefix.
  std::vector<int32_t> other = prompt;
  other[2] = 9999;
  ASSERT_TRUE(AppendPrompt(cache, 3, 0, 6, other).ok());
  ASSERT_TRUE(cache.Restore(3, tail->id, 12).ok());
  EXPECT_EQ(cache.Tokens(3).ids().size(), 12u);
  EXPECT_EQ(cache.Tokens(3).taint(), 6);
  EXPECT_EQ(cache.Tokens(3).exact(), 6);
  // A rewind without a snapshot cuts the chain.
  ASSERT_TRUE(cache.Restore(2, std::nullopt, 5).ok());
  EXPECT_EQ(cache.Tokens(2).ids(), Slice(prompt, 0, 5));
}

TEST(CacheTokensTest, MergeAndSplitKeepTheIds) {
  TestCache tc(FullSpec());
  Cache& cache = *tc.cache;
  const std::vector<int32_t> prompt = Prompt(12);
  ASSERT_TRUE(AppendPrompt(cache, 0, 0, 12, prompt).ok());
  absl::StatusOr<SnapshotInfo> snap = cache.Snapshot(0, 0);
  ASSERT_TRUE(snap.ok());
  absl::StatusOr<SplitResult> split = cache.SplitSnapshot(snap->id, 5);
  ASSERT_TRUE(split.ok()) << split.status();
  ASSERT_TRUE(split->parent.has_value() && split->child.has_value());
  EXPECT_EQ(split->parent->tokens, 5);
  EXPECT_EQ(split->child->tokens, 12);
  absl::StatusOr<SnapshotInfo> merged = cache.MergeSnapshots(split->parent->id, split->child->id);
  ASSERT_TRUE(merged.ok()) << merged.status();
  EXPECT_EQ(merged->tokens, 12);
  ASSERT_TRUE(cache.Restore(1, merged->id, 12).ok());
  EXPECT_EQ(cache.Tokens(1).ids(), prompt);
  EXPECT_EQ(cache.Tokens(1).exact(), 12);
}

TEST(CacheTokensTest, WireImagesCarryTheIds) {
  TestCache src(FullSpec());
  TestCache dst(FullSpec());
  const std::vector<int32_t> prompt = Prompt(10);
  ASSERT_TRUE(AppendPrompt(*src.cache, 0, 0, 10, prompt).ok());
  ASSERT_TRUE(AppendRange(*src.cache, 1, 0, 10).ok());
  for (int64_t seq : {0, 1}) {
    absl::StatusOr<SnapshotInfo> snap = src.cache->Snapshot(seq, 0);
    ASSERT_TRUE(snap.ok());
    absl::StatusOr<std::unique_ptr<SnapshotExportReader>> reader =
        src.cache->OpenSnapshotExport(snap->id);
    ASSERT_TRUE(reader.ok());
    std::vector<uint8_t> image((*reader)->size());
    ASSERT_TRUE((*reader)->ReadAt(0, absl::MakeSpan(image)).ok());
    uint32_t version = 0;
    std::memcpy(&version, image.data() + 8, 4);
    // Version 1 without ids, so that nodes that read only version 1 still take it.
    EXPECT_EQ(version, seq == 0 ? 2u : 1u);
    absl::StatusOr<std::unique_ptr<SnapshotImportWriter>> writer =
        dst.cache->BeginSnapshotImport(image.size());
    ASSERT_TRUE(writer.ok());
    ASSERT_TRUE((*writer)->Write(image).ok());
    absl::StatusOr<SnapshotInfo> imported = (*writer)->Commit();
    ASSERT_TRUE(imported.ok()) << imported.status();
    ASSERT_TRUE(dst.cache->Restore(seq, imported->id, 10).ok());
    EXPECT_EQ(dst.cache->Tokens(seq).hashes(), src.cache->Tokens(seq).hashes());
    EXPECT_EQ(dst.cache->Tokens(seq).ids(), src.cache->Tokens(seq).ids());
  }
  // The sequence path (cells lent to the export, imported into cells).
  std::shared_ptr<Cache> from(std::move(src.cache));
  std::shared_ptr<Cache> to(std::move(dst.cache));
  absl::StatusOr<std::unique_ptr<SnapshotExportReader>> reader =
      Cache::OpenSequenceExport(from, 0, 0, 7);
  ASSERT_TRUE(reader.ok()) << reader.status();
  std::vector<uint8_t> image((*reader)->size());
  ASSERT_TRUE((*reader)->ReadAt(0, absl::MakeSpan(image)).ok());
  absl::StatusOr<std::unique_ptr<SequenceImport>> import =
      Cache::BeginSequenceImport(to, image.size());
  ASSERT_TRUE(import.ok());
  ASSERT_TRUE((*import)->Write(image).ok());
  ASSERT_TRUE((*import)->Commit().ok());
  ASSERT_TRUE(to->RestoreImport(5, **import, 7).ok());
  EXPECT_EQ(to->Tokens(5).ids(), Slice(prompt, 0, 7));
  EXPECT_EQ(to->Tokens(5).hashes().size(), 1u);
  src.cache.reset();
  dst.cache.reset();
  import->reset();
  reader->reset();
  to.reset();
  from.reset();
}

TEST(CacheTokensTest, APrunedPositionAppendedAgainCutsTheIds) {
  CacheSpec spec = Spec(DType::kF16, 2, 16, 16, {Group(Sliding(4), 1, 1, 4, 4)});
  spec.token_block_size = 2;
  TestCache tc(spec);
  Cache& cache = *tc.cache;
  const std::vector<int32_t> prompt = Prompt(14);
  ASSERT_TRUE(AppendPrompt(cache, 0, 0, 12, prompt).ok());
  ASSERT_TRUE(AppendPrompt(cache, 0, 12, 14, prompt).ok());  // prunes what the window left
  EXPECT_GT(testutil::StoredPositions(cache, 0)[0].front(), 1);
  EXPECT_EQ(cache.Tokens(0).ids(), prompt);  // pruning keeps the ids
  std::vector<int32_t> again = prompt;
  again[1] = 5;
  const absl::Status appended = AppendPrompt(cache, 0, 1, 2, again);
  ASSERT_TRUE(appended.ok()) << appended;
  EXPECT_EQ(cache.Tokens(0).ids(), (std::vector<int32_t>{100, 5}));
}

TEST(CacheTokensTest, HybridCachesKeepIdsThroughSnapshotsAndRestores) {
  CacheSpec spec = Spec(DType::kF16, 3, 32, 16, {Group(Full(), 1, 1, 4, 4), RecurrentGroup()});
  spec.token_block_size = 4;
  TestCache tc(spec);
  Cache& cache = *tc.cache;
  const std::vector<int32_t> prompt = Prompt(9);
  ASSERT_TRUE(AppendPrompt(cache, 0, 0, 9, prompt).ok());
  absl::StatusOr<SnapshotInfo> snap = cache.Snapshot(0, 0);
  ASSERT_TRUE(snap.ok()) << snap.status();
  ASSERT_TRUE(cache.Restore(1, snap->id, 9).ok());
  EXPECT_EQ(cache.Tokens(1).ids(), prompt);
  EXPECT_EQ(cache.Tokens(1).hashes(), cache.Tokens(0).hashes());
}

// ---- LookupPrefix ---------------------------------------------------------------------------

namespace lookup {

// The longest exact prefix any sequence of `cache` shares with `prompt`, found by walking every
// chain: what the index must find.
int32_t BruteForceLongest(const Cache& cache, const std::vector<int32_t>& prompt) {
  int32_t best = 0;
  for (const SequenceInfo& info : cache.ListSequences()) {
    const TokenChain chain = cache.Tokens(info.seq);
    int32_t same = 0;
    while (same < chain.exact() && static_cast<size_t>(same) < prompt.size() &&
           chain.ids()[static_cast<size_t>(same)] == prompt[static_cast<size_t>(same)]) {
      ++same;
    }
    best = std::max(best, same);
  }
  return best >= cache.spec().token_block_size ? best : 0;
}

}  // namespace lookup

TEST(CacheLookupTest, FindsTheLongestVerifiedPrefix) {
  TestCache tc(FullSpec());
  Cache& cache = *tc.cache;
  const std::vector<int32_t> prompt = Prompt(20);
  std::vector<int32_t> other = prompt;
  other[9] = 7;  // shares 9 tokens: two whole blocks and one more
  ASSERT_TRUE(AppendPrompt(cache, 0, 0, 14, prompt).ok());
  ASSERT_TRUE(AppendPrompt(cache, 1, 0, 12, other).ok());
  absl::StatusOr<std::vector<PrefixMatch>> got = cache.LookupPrefix(prompt, 4);
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->size(), 2u);
  EXPECT_EQ((*got)[0].seq, 0);
  EXPECT_EQ((*got)[0].length, 14);
  EXPECT_EQ((*got)[0].offset, 14);
  EXPECT_TRUE((*got)[0].can_resume);
  EXPECT_EQ((*got)[1].seq, 1);
  EXPECT_EQ((*got)[1].length, 9);
  // max_matches 1: the longest only. A prompt shorter than a block, or matching less than one,
  // finds nothing.
  got = cache.LookupPrefix(prompt, 1);
  ASSERT_TRUE(got.ok());
  ASSERT_EQ(got->size(), 1u);
  EXPECT_EQ((*got)[0].seq, 0);
  EXPECT_TRUE(cache.LookupPrefix(Slice(prompt, 0, 3), 4)->empty());
  EXPECT_TRUE(cache.LookupPrefix(Prompt(20, 500), 4)->empty());
  // A shift ends what can be shared at the removed range.
  ASSERT_TRUE(cache.Remove(0, 5, 6).ok());
  got = cache.LookupPrefix(prompt, 4);
  ASSERT_TRUE(got.ok());
  ASSERT_EQ(got->size(), 2u);
  EXPECT_EQ((*got)[0].seq, 1);
  EXPECT_EQ((*got)[1].seq, 0);
  EXPECT_EQ((*got)[1].length, 5);
  // Gone sequences leave nothing in the index.
  ASSERT_TRUE(cache.Remove(0, 0, std::nullopt).ok());
  ASSERT_TRUE(cache.Remove(1, 0, std::nullopt).ok());
  EXPECT_TRUE(cache.LookupPrefix(prompt, 4)->empty());
  const TokenIndexStats stats = cache.TokenIndex();
  EXPECT_EQ(stats.sequences, 0u);
  EXPECT_EQ(stats.hashes, 0u);
  EXPECT_EQ(stats.entries, 0u);
}

TEST(CacheLookupTest, BadArguments) {
  TestCache tc(FullSpec());
  EXPECT_TRUE(IsError(tc.cache->LookupPrefix({1, -2}, 1).status(),
                      absl::StatusCode::kInvalidArgument, {"tokens[1] = -2"}));
  EXPECT_TRUE(IsError(tc.cache->LookupPrefix({1, 2}, 0).status(),
                      absl::StatusCode::kInvalidArgument, {"max_matches = 0"}));
}

TEST(CacheLookupTest, ResumingAHybridSequenceNeedsTheWholeSequence) {
  CacheSpec spec = Spec(DType::kF16, 3, 32, 16, {Group(Full(), 1, 1, 4, 4), RecurrentGroup()});
  spec.token_block_size = 4;
  TestCache tc(spec);
  Cache& cache = *tc.cache;
  const std::vector<int32_t> prompt = Prompt(12);
  ASSERT_TRUE(AppendPrompt(cache, 0, 0, 12, prompt).ok());
  absl::StatusOr<std::vector<PrefixMatch>> got = cache.LookupPrefix(Slice(prompt, 0, 10), 1);
  ASSERT_TRUE(got.ok());
  ASSERT_EQ(got->size(), 1u);
  EXPECT_EQ((*got)[0].length, 10);
  EXPECT_FALSE((*got)[0].can_resume);  // the recurrent state is at 12, not 10
  got = cache.LookupPrefix(Prompt(16), 1);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ((*got)[0].length, 12);
  EXPECT_TRUE((*got)[0].can_resume);
}

// With 2-bit hashes nearly every block collides: the index offers wrong candidates all the
// time, and every answer must still be the longest prefix the chains really hold.
TEST(CacheLookupTest, ForcedCollisionsNeverGiveAWrongPrefix) {
  TestCache tc(FullSpec());
  absl::StatusOr<std::unique_ptr<Cache>> created =
      Cache::Create(FullSpec(), tc.device.get(), kDefaultTenant, /*token_hash_bits=*/2);
  ASSERT_TRUE(created.ok()) << created.status();
  Cache& cache = **created;
  std::mt19937 rng(11);
  std::vector<std::vector<int32_t>> prompts;
  for (int64_t seq = 0; seq < 4; ++seq) {
    std::vector<int32_t> p(24);
    for (int32_t& id : p) id = static_cast<int32_t>(rng() % 3);
    prompts.push_back(p);
    ASSERT_TRUE(AppendPrompt(cache, seq, 0, 24, p).ok());
  }
  for (int trial = 0; trial < 500; ++trial) {
    // A prompt that starts like one of them and goes on at random.
    std::vector<int32_t> prompt = prompts[rng() % prompts.size()];
    prompt.resize(rng() % 25);
    while (prompt.size() < 30) prompt.push_back(static_cast<int32_t>(rng() % 3));
    absl::StatusOr<std::vector<PrefixMatch>> got = cache.LookupPrefix(prompt, 8);
    ASSERT_TRUE(got.ok());
    const int32_t best = lookup::BruteForceLongest(cache, prompt);
    ASSERT_EQ(got->empty() ? 0 : (*got)[0].length, best) << "trial " << trial;
    for (const PrefixMatch& m : *got) {
      const TokenChain chain = cache.Tokens(m.seq);
      ASSERT_LE(m.length, chain.exact());
      ASSERT_TRUE(std::equal(prompt.begin(), prompt.begin() + m.length, chain.ids().begin()));
    }
  }
}
}  // namespace
}  // namespace kvmesh

namespace kvmesh {
namespace {

// A sequence matched deep in the prompt holds every block above too: it must not use up the
// comparisons that find the shorter matches below it.
TEST(CacheLookupTest, ADeepMatchLeavesRoomForShorterOnes) {
  CacheSpec spec = FullSpec();
  spec.token_block_size = 1;
  spec.capacity = 256;
  spec.max_batch = 128;
  TestCache tc(spec);
  Cache& cache = *tc.cache;
  const std::vector<int32_t> prompt = Prompt(128);
  ASSERT_TRUE(AppendPrompt(cache, 0, 0, 128, prompt).ok());
  ASSERT_TRUE(AppendPrompt(cache, 1, 0, 5, prompt).ok());
  absl::StatusOr<std::vector<PrefixMatch>> got = cache.LookupPrefix(prompt, 2);
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->size(), 2u);
  EXPECT_EQ((*got)[0].seq, 0);
  EXPECT_EQ((*got)[0].length, 128);
  EXPECT_EQ((*got)[1].seq, 1);
  EXPECT_EQ((*got)[1].length, 5);
}

// With 2-bit hashes a chain holds the same hash many times, so the index lists it as often:
// it is still one match.
TEST(CacheLookupTest, ASequenceIsOneMatchHoweverOftenTheIndexListsIt) {
  CacheSpec spec = FullSpec();
  spec.token_block_size = 2;
  TestCache tc(spec);
  absl::StatusOr<std::unique_ptr<Cache>> created =
      Cache::Create(spec, tc.device.get(), kDefaultTenant, /*token_hash_bits=*/2);
  ASSERT_TRUE(created.ok()) << created.status();
  const std::vector<int32_t> prompt = Prompt(32);
  ASSERT_TRUE(AppendPrompt(**created, 0, 0, 32, prompt).ok());
  absl::StatusOr<std::vector<PrefixMatch>> got = (*created)->LookupPrefix(prompt, 4);
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->size(), 1u);
  EXPECT_EQ((*got)[0].length, 32);
}

RestoreOptions KeepsPrefix() {
  RestoreOptions options;
  options.keeps_prefix = true;
  return options;
}

// A Restore that keeps the destination's prefix (the receiver's side of an incremental pull):
// the snapshot from position 8 on is restored into sequences whose first 8 ids are the
// snapshot's sequence's, and refused (changing nothing) for one whose ids differ.
TEST(CacheTokensTest, RestoreKeepingThePrefixNeedsTheSameIdsThere) {
  TestCache t(FullSpec());
  Cache& cache = *t.cache;
  const std::vector<int32_t> prompt = Prompt(16);
  ASSERT_TRUE(AppendPrompt(cache, 1, 0, 16, prompt).ok());
  absl::StatusOr<SnapshotInfo> tail = cache.Snapshot(1, 8);
  ASSERT_TRUE(tail.ok()) << tail.status();
  // Same ids, other data (salt 2): keeps its own first 8 positions, gets the snapshot's rest.
  ASSERT_TRUE(AppendPrompt(cache, 2, 0, 12, prompt, /*salt=*/2).ok());
  ASSERT_TRUE(cache.Restore(2, tail->id, 16, KeepsPrefix()).ok());
  absl::StatusOr<ReadResult> read = cache.Read(2, 0, std::nullopt);
  ASSERT_TRUE(read.ok());
  const std::vector<uint64_t> ids = {
      testutil::TokenId(2, 0, 2), testutil::TokenId(2, 1, 2), testutil::TokenId(2, 2, 2),
      testutil::TokenId(2, 3, 2), testutil::TokenId(2, 4, 2), testutil::TokenId(2, 5, 2),
      testutil::TokenId(2, 6, 2), testutil::TokenId(2, 7, 2), testutil::TokenId(1, 8),
      testutil::TokenId(1, 9),    testutil::TokenId(1, 10),   testutil::TokenId(1, 11),
      testutil::TokenId(1, 12),   testutil::TokenId(1, 13),   testutil::TokenId(1, 14),
      testutil::TokenId(1, 15)};
  EXPECT_TRUE(testutil::SameBytes(testutil::ReadPayload(cache.spec(), {ids}), read->payload));
  std::optional<SequenceInfo> info = FindSequence(cache, 2);
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->exact_tokens, 16);
  // Other ids below 8, or none: refused, nothing changes.
  ASSERT_TRUE(AppendPrompt(cache, 3, 0, 8, Prompt(8, 500)).ok());
  ASSERT_TRUE(AppendRange(cache, 4, 0, 8).ok());
  const CacheState before = CaptureState(cache);
  for (int64_t seq : {3, 4}) {
    EXPECT_TRUE(IsError(cache.Restore(seq, tail->id, 16, KeepsPrefix()),
                        absl::StatusCode::kFailedPrecondition, {"[0, 8)"}));
  }
  EXPECT_TRUE(SameState(before, CaptureState(cache)));
  // Without keeps_prefix, as before: the snapshot's data lands on whatever lies below it.
  EXPECT_TRUE(cache.Restore(3, tail->id, 16).ok());
}

}  // namespace
}  // namespace kvmesh
