// Cache::BeginAppend and AppendWriter: an Append whose payload arrives piece by piece. Whatever
// the pieces, a committed writer leaves the cache exactly as Cache::Append of the whole payload
// does on a twin cache; a writer given up (destroyed, over-written, failed on the device) leaves
// it exactly as before; and Commit judges the batch against the cache as it is then, since
// other operations, on the batch's sequences too, go on while the bytes arrive.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cache/cache.h"
#include "cache/device/host_device.h"
#include "gtest/gtest.h"
#include "tests/unit/cache_test_util.h"

namespace kvmesh {
namespace {

using testutil::AppendRange;
using testutil::AppendSpeculative;
using testutil::CaptureState;
using testutil::Full;
using testutil::Group;
using testutil::IsError;
using testutil::MatchesRows;
using testutil::PayloadFor;
using testutil::Range;
using testutil::RecurrentGroup;
using testutil::Rope;
using testutil::RotatingGroup;
using testutil::SameState;
using testutil::Sliding;
using testutil::Spec;
using testutil::StoredPositions;
using testutil::TestCache;
using testutil::Tokens;
using testutil::ToString;
using testutil::Unshifted;

std::shared_ptr<Cache> Shared(TestCache& tc) { return std::shared_ptr<Cache>(std::move(tc.cache)); }

// Two groups whose planes have different row sizes (K rows 16 bytes, V rows 8; then 8 and 4).
CacheSpec AttentionSpec() {
  return Spec(DType::kF16, 4, 64, 32,
              {Group(Full(), 2, 2, 4, 2, Rope(RopeType::kNormal, 4)), Group(Full(), 1, 1, 4, 2)});
}

CacheSpec SlidingSpec() { return Spec(DType::kF16, 1, 16, 16, {Group(Sliding(4), 1, 1, 4, 4)}); }

CacheSpec HybridSpec() {
  return Spec(DType::kF16, 4, 64, 16,
              {Group(Full(), 1, 1, 4, 4), RotatingGroup(4), RecurrentGroup()});
}

// Writes `payload` in pieces of `piece` bytes (the last one shorter).
absl::Status WriteInPieces(AppendWriter& writer, const std::vector<uint8_t>& payload,
                           size_t piece) {
  for (size_t at = 0; at < payload.size(); at += piece) {
    const size_t n = std::min(piece, payload.size() - at);
    absl::Status status = writer.Write(absl::MakeConstSpan(payload).subspan(at, n));
    if (!status.ok()) return status;
  }
  return absl::OkStatus();
}

// A writer committed equals Cache::Append on a twin, for every piece size, on caches that
// write into cells and on one that buffers.
TEST(CacheAppendWriterTest, CommittedEqualsAppendForEveryPieceSize) {
  struct Case {
    const char* name;
    CacheSpec spec;
    bool in_cells;
  };
  for (const Case& c :
       {Case{"attention", AttentionSpec(), true}, Case{"hybrid (buffered)", HybridSpec(), false}}) {
    // Two sequences interleaved in one batch, after each holds a few tokens already.
    std::vector<Token> batch;
    for (int32_t p = 3; p < 9; ++p) {
      batch.push_back(Token{0, p});
      batch.push_back(Token{1, p});
    }
    const std::vector<uint8_t> payload = PayloadFor(c.spec, batch, /*salt=*/7);
    for (size_t piece : {size_t{1}, size_t{3}, size_t{7}, size_t{8}, size_t{15}, size_t{16},
                         size_t{17}, size_t{100}, payload.size()}) {
      SCOPED_TRACE(testing::Message() << c.name << ", pieces of " << piece);
      TestCache reference_tc(c.spec);
      TestCache tc(c.spec);
      std::shared_ptr<Cache> cache = Shared(tc);
      for (Cache* each : {reference_tc.cache.get(), cache.get()}) {
        ASSERT_TRUE(AppendRange(*each, 0, 0, 3).ok());
        ASSERT_TRUE(AppendRange(*each, 1, 0, 3).ok());
      }
      ASSERT_TRUE(reference_tc.cache->Append(batch, payload).ok());

      absl::StatusOr<std::unique_ptr<AppendWriter>> writer =
          Cache::BeginAppend(cache, batch, payload.size());
      ASSERT_TRUE(writer.ok()) << writer.status();
      EXPECT_EQ((*writer)->in_cells(), c.in_cells);
      EXPECT_EQ((*writer)->size(), payload.size());
      ASSERT_TRUE(WriteInPieces(**writer, payload, piece).ok());
      EXPECT_EQ((*writer)->written(), payload.size());
      ASSERT_TRUE((*writer)->Commit().ok());
      EXPECT_TRUE(SameState(CaptureState(*reference_tc.cache), CaptureState(*cache)));
      // Used up.
      EXPECT_TRUE(IsError((*writer)->Commit(), absl::StatusCode::kFailedPrecondition,
                          {"committed already"}));
    }
  }
}

TEST(CacheAppendWriterTest, SpeculativeEqualsAppend) {
  for (const CacheSpec& spec : {AttentionSpec(), HybridSpec()}) {
    TestCache reference_tc(spec);
    TestCache tc(spec);
    std::shared_ptr<Cache> cache = Shared(tc);
    for (Cache* each : {reference_tc.cache.get(), cache.get()}) {
      ASSERT_TRUE(AppendRange(*each, 0, 0, 4).ok());
    }
    ASSERT_TRUE(AppendSpeculative(*reference_tc.cache, 0, 4, 7).ok());
    const std::vector<Token> tokens = Tokens(0, 4, 7);
    const std::vector<uint8_t> payload = PayloadFor(spec, tokens, 0, /*speculative=*/true);
    absl::StatusOr<std::unique_ptr<AppendWriter>> writer =
        Cache::BeginAppend(cache, tokens, payload.size(), /*speculative=*/true);
    ASSERT_TRUE(writer.ok()) << writer.status();
    ASSERT_TRUE(WriteInPieces(**writer, payload, 5).ok());
    ASSERT_TRUE((*writer)->Commit().ok());
    EXPECT_TRUE(SameState(CaptureState(*reference_tc.cache), CaptureState(*cache)));
    for (Cache* each : {reference_tc.cache.get(), cache.get()}) {
      ASSERT_TRUE(each->CommitSpeculation(0, 1).ok());
    }
    EXPECT_TRUE(SameState(CaptureState(*reference_tc.cache), CaptureState(*cache)));
  }
}

// The cells are taken when the writer begins (used, in no sequence) and given back when it is
// given up at any point: the cache is then exactly as before.
TEST(CacheAppendWriterTest, GivenUpAtAnyPointLeavesTheCacheAsBefore) {
  const CacheSpec spec = AttentionSpec();
  TestCache tc(spec);
  std::shared_ptr<Cache> cache = Shared(tc);
  ASSERT_TRUE(AppendRange(*cache, 0, 0, 5).ok());
  const testutil::CacheState before = CaptureState(*cache);
  const std::vector<Token> tokens = Tokens(1, 0, 20);
  const std::vector<uint8_t> payload = PayloadFor(spec, tokens);
  for (size_t stop : {size_t{0}, size_t{1}, payload.size() / 2, payload.size()}) {
    SCOPED_TRACE(testing::Message() << "given up after " << stop << " bytes");
    absl::StatusOr<std::unique_ptr<AppendWriter>> writer =
        Cache::BeginAppend(cache, tokens, payload.size());
    ASSERT_TRUE(writer.ok()) << writer.status();
    ASSERT_TRUE((*writer)->in_cells());
    EXPECT_EQ(cache->Usage().groups[0].cells_used, 25);
    EXPECT_FALSE(cache->IsLive(1));
    ASSERT_TRUE((*writer)->Write(absl::MakeConstSpan(payload).first(stop)).ok());
    writer->reset();
    EXPECT_TRUE(SameState(before, CaptureState(*cache)));
  }
  // Past the payload's size: refused, final, and the cells are given back at once.
  absl::StatusOr<std::unique_ptr<AppendWriter>> writer =
      Cache::BeginAppend(cache, tokens, payload.size());
  ASSERT_TRUE(writer.ok());
  ASSERT_TRUE((*writer)->Write(absl::MakeConstSpan(payload).first(10)).ok());
  EXPECT_TRUE(IsError((*writer)->Write(payload), absl::StatusCode::kInvalidArgument,
                      {std::to_string(payload.size())}));
  EXPECT_TRUE(SameState(before, CaptureState(*cache)));
  EXPECT_TRUE(IsError((*writer)->Write(absl::MakeConstSpan(payload).first(1)),
                      absl::StatusCode::kInvalidArgument, {"exceeds"}));
  EXPECT_TRUE(IsError((*writer)->Commit(), absl::StatusCode::kInvalidArgument, {"exceeds"}));
}

TEST(CacheAppendWriterTest, CommitBeforeEveryByteIsRefusedAndChangesNothing) {
  const CacheSpec spec = AttentionSpec();
  TestCache tc(spec);
  std::shared_ptr<Cache> cache = Shared(tc);
  const testutil::CacheState before = CaptureState(*cache);
  const std::vector<Token> tokens = Tokens(0, 0, 4);
  const std::vector<uint8_t> payload = PayloadFor(spec, tokens);
  absl::StatusOr<std::unique_ptr<AppendWriter>> writer =
      Cache::BeginAppend(cache, tokens, payload.size());
  ASSERT_TRUE(writer.ok());
  ASSERT_TRUE((*writer)->Write(absl::MakeConstSpan(payload).first(payload.size() - 1)).ok());
  EXPECT_TRUE(IsError((*writer)->Commit(), absl::StatusCode::kFailedPrecondition,
                      {std::to_string(payload.size() - 1), std::to_string(payload.size())}));
  // Not final: the last byte may still come.
  ASSERT_TRUE((*writer)->Write(absl::MakeConstSpan(payload).last(1)).ok());
  ASSERT_TRUE((*writer)->Commit().ok());
  EXPECT_EQ(testutil::StoredPositions(*cache, 0)[0], Range(0, 4));
  EXPECT_FALSE(SameState(before, CaptureState(*cache)));
}

// BeginAppend refuses what Append refuses, with the same errors, and changes nothing.
TEST(CacheAppendWriterTest, BeginRefusesWhatAppendRefuses) {
  const CacheSpec spec = AttentionSpec();
  TestCache tc(spec);
  std::shared_ptr<Cache> cache = Shared(tc);
  ASSERT_TRUE(AppendRange(*cache, 0, 0, 4).ok());
  for (int64_t seq = 1; seq < 4; ++seq) ASSERT_TRUE(AppendRange(*cache, seq, 0, 1).ok());
  const testutil::CacheState before = CaptureState(*cache);
  struct Case {
    const char* name;
    std::vector<Token> tokens;
    std::optional<size_t> payload_bytes;  // absent: the right size
    absl::StatusCode code;
    std::vector<std::string> words;
  };
  const std::vector<Case> cases = {
      {"empty", {}, 0, absl::StatusCode::kInvalidArgument, {"empty"}},
      {"wrong size", Tokens(0, 4, 6), 3, absl::StatusCode::kInvalidArgument, {"3"}},
      {"negative seq", {Token{-1, 0}}, std::nullopt, absl::StatusCode::kInvalidArgument, {"-1"}},
      {"INT32_MAX",
       {Token{0, INT32_MAX}},
       std::nullopt,
       absl::StatusCode::kInvalidArgument,
       {"2147483647"}},
      {"stored",
       Tokens(0, 3, 5),
       std::nullopt,
       absl::StatusCode::kInvalidArgument,
       {"already stores position 3"}},
      {"max_sequences",
       Tokens(9, 0, 1),
       std::nullopt,
       absl::StatusCode::kResourceExhausted,
       {"max_sequences = 4"}},
      {"over max_batch",
       Tokens(0, 4, 37),
       std::nullopt,
       absl::StatusCode::kInvalidArgument,
       {"max_batch"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const size_t bytes =
        c.payload_bytes.has_value()
            ? *c.payload_bytes
            : AppendPayloadBytes(spec, static_cast<int64_t>(c.tokens.size()), 1, false);
    const absl::StatusOr<std::unique_ptr<AppendWriter>> writer =
        Cache::BeginAppend(cache, c.tokens, bytes);
    EXPECT_TRUE(IsError(writer.status(), c.code, c.words));
    EXPECT_TRUE(SameState(before, CaptureState(*cache)));
  }
}

// The cells a writer takes are not free for the next one.
TEST(CacheAppendWriterTest, WritersTakeTheirCellsAtOnce) {
  const CacheSpec spec = Spec(DType::kF16, 2, 20, 32, {Group(Full())});  // 40 cells
  TestCache tc(spec);
  std::shared_ptr<Cache> cache = Shared(tc);
  ASSERT_TRUE(AppendRange(*cache, 0, 0, 4).ok());
  const testutil::CacheState before = CaptureState(*cache);
  const std::vector<Token> tokens = Tokens(0, 4, 24);
  absl::StatusOr<std::unique_ptr<AppendWriter>> first =
      Cache::BeginAppend(cache, tokens, PayloadFor(spec, tokens).size());
  ASSERT_TRUE(first.ok()) << first.status();
  const std::vector<Token> more = Tokens(1, 0, 20);
  EXPECT_TRUE(IsError(Cache::BeginAppend(cache, more, PayloadFor(spec, more).size()).status(),
                      absl::StatusCode::kResourceExhausted, {"20 tokens", "16 of 40"}));
  EXPECT_TRUE(
      IsError(AppendRange(*cache, 1, 0, 20), absl::StatusCode::kResourceExhausted, {"16 of 40"}));
  first->reset();
  EXPECT_TRUE(SameState(before, CaptureState(*cache)));
  EXPECT_TRUE(AppendRange(*cache, 1, 0, 20).ok());
}

// While the bytes arrive, the cache goes on, on the batch's own sequences too; Commit judges
// the batch against what the cache holds then.
TEST(CacheAppendWriterTest, CommitJudgesTheBatchAgainstTheCacheAsItIsThen) {
  const CacheSpec spec = AttentionSpec();
  const std::vector<Token> tokens = Tokens(0, 4, 8);
  const std::vector<uint8_t> payload = PayloadFor(spec, tokens);
  struct Case {
    const char* name;
    std::function<absl::Status(Cache&)> meanwhile;
    absl::StatusCode code;  // kOk: Commit succeeds
    std::vector<std::string> words;
  };
  const std::vector<Case> cases = {
      {"another Append stored position 5",
       [](Cache& c) { return AppendRange(c, 0, 5, 6, 1); },
       absl::StatusCode::kInvalidArgument,
       {"already stores position 5"}},
      {"the sequence began speculating",
       [](Cache& c) { return AppendSpeculative(c, 0, 20, 21); },
       absl::StatusCode::kAborted,
       {"sequence 0", "pending"}},
      {"truncated below the batch",
       [](Cache& c) { return c.Remove(0, 2, std::nullopt); },
       absl::StatusCode::kOk,
       {}},
      {"forked and removed",
       [](Cache& c) {
         absl::Status s = c.CopyPrefix(0, 2, 4);
         return s.ok() ? c.Remove(0, 0, std::nullopt) : s;
       },
       absl::StatusCode::kOk,
       {}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    TestCache reference_tc(spec);
    TestCache tc(spec);
    std::shared_ptr<Cache> cache = Shared(tc);
    for (Cache* each : {reference_tc.cache.get(), cache.get()}) {
      ASSERT_TRUE(AppendRange(*each, 0, 0, 4).ok());
    }
    absl::StatusOr<std::unique_ptr<AppendWriter>> writer =
        Cache::BeginAppend(cache, tokens, payload.size());
    ASSERT_TRUE(writer.ok()) << writer.status();
    ASSERT_TRUE((*writer)->Write(absl::MakeConstSpan(payload).first(9)).ok());
    // Does not wait for the writer, which holds no claim on sequence 0.
    ASSERT_TRUE(c.meanwhile(*cache).ok());
    ASSERT_TRUE(c.meanwhile(*reference_tc.cache).ok());
    ASSERT_TRUE((*writer)->Write(absl::MakeConstSpan(payload).subspan(9)).ok());
    const absl::Status committed = (*writer)->Commit();
    if (c.code == absl::StatusCode::kOk) {
      ASSERT_TRUE(committed.ok()) << committed;
      ASSERT_TRUE(reference_tc.cache->Append(tokens, payload).ok());
    } else {
      EXPECT_TRUE(IsError(committed, c.code, c.words));
    }
    EXPECT_TRUE(SameState(CaptureState(*reference_tc.cache), CaptureState(*cache)));
  }
}

TEST(CacheAppendWriterTest, SequencesFilledMeanwhileRefuseTheCommit) {
  const CacheSpec spec = AttentionSpec();  // max_sequences = 4
  TestCache reference_tc(spec);
  TestCache tc(spec);
  std::shared_ptr<Cache> cache = Shared(tc);
  const std::vector<Token> tokens = Tokens(7, 0, 2);
  const std::vector<uint8_t> payload = PayloadFor(spec, tokens);
  absl::StatusOr<std::unique_ptr<AppendWriter>> writer =
      Cache::BeginAppend(cache, tokens, payload.size());
  ASSERT_TRUE(writer.ok());
  ASSERT_TRUE((*writer)->Write(payload).ok());
  // The writer claims no sequence slot before its commit.
  for (int64_t seq = 0; seq < 4; ++seq) {
    ASSERT_TRUE(AppendRange(*cache, seq, 0, 1).ok());
    ASSERT_TRUE(AppendRange(*reference_tc.cache, seq, 0, 1).ok());
  }
  EXPECT_TRUE(
      IsError((*writer)->Commit(), absl::StatusCode::kResourceExhausted, {"max_sequences = 4"}));
  EXPECT_TRUE(SameState(CaptureState(*reference_tc.cache), CaptureState(*cache)));
}

// A sliding window whose free cells would come from pruning: the writer buffers, since a
// reservation that prunes could not be given back whole; its commit prunes as Append does.
TEST(CacheAppendWriterTest, CellsThatNeedPruningAreNotTakenEarly) {
  const CacheSpec spec = SlidingSpec();
  TestCache reference_tc(spec);
  TestCache tc(spec);
  std::shared_ptr<Cache> cache = Shared(tc);
  ASSERT_EQ(cache->Usage().groups[0].cells_total, 20);  // memory 4 + max_batch 16
  for (Cache* each : {reference_tc.cache.get(), cache.get()}) {
    ASSERT_TRUE(AppendRange(*each, 0, 0, 12).ok());
  }
  // 8 cells are free; 16 are needed, and pruning positions below 8 gives the rest.
  const std::vector<Token> tokens = Tokens(0, 12, 28);
  const std::vector<uint8_t> payload = PayloadFor(spec, tokens);
  absl::StatusOr<std::unique_ptr<AppendWriter>> writer =
      Cache::BeginAppend(cache, tokens, payload.size());
  ASSERT_TRUE(writer.ok()) << writer.status();
  EXPECT_FALSE((*writer)->in_cells());
  EXPECT_EQ((*writer)->host_bytes(), payload.size());
  const testutil::CacheState before = CaptureState(*cache);
  ASSERT_TRUE(WriteInPieces(**writer, payload, 3).ok());
  EXPECT_TRUE(SameState(before, CaptureState(*cache)));
  ASSERT_TRUE((*writer)->Commit().ok());
  ASSERT_TRUE(reference_tc.cache->Append(tokens, payload).ok());
  EXPECT_TRUE(SameState(CaptureState(*reference_tc.cache), CaptureState(*cache)));
  // With room, the same window writes into cells.
  for (Cache* each : {reference_tc.cache.get(), cache.get()}) {
    ASSERT_TRUE(each->Remove(0, 26, std::nullopt).ok());
  }
  const std::vector<Token> next = Tokens(0, 26, 28);
  absl::StatusOr<std::unique_ptr<AppendWriter>> in_cells =
      Cache::BeginAppend(cache, next, PayloadFor(spec, next).size());
  ASSERT_TRUE(in_cells.ok());
  EXPECT_TRUE((*in_cells)->in_cells());
  EXPECT_LT((*in_cells)->host_bytes(), PayloadFor(spec, next).size());
}

// A HostDevice whose Scatter fails once armed.
class FailingDevice : public HostDevice {
 public:
  FailingDevice() : HostDevice(size_t{1} << 26) {}
  bool fail = false;
  absl::Status Scatter(const DeviceArena& arena, absl::Span<const Plane> planes,
                       absl::Span<const int32_t> rows, const uint8_t* src) override {
    if (fail) return absl::DataLossError("scatter failed as told");
    return HostDevice::Scatter(arena, planes, rows, src);
  }
};

TEST(CacheAppendWriterTest, ADeviceErrorIsFinalAndGivesTheCellsBack) {
  FailingDevice device;
  absl::StatusOr<std::unique_ptr<Cache>> created = Cache::Create(AttentionSpec(), &device);
  ASSERT_TRUE(created.ok());
  std::shared_ptr<Cache> cache = std::move(created).value();
  ASSERT_TRUE(AppendRange(*cache, 0, 0, 4).ok());
  const testutil::CacheState before = CaptureState(*cache);
  const std::vector<Token> tokens = Tokens(0, 4, 12);
  const std::vector<uint8_t> payload = PayloadFor(cache->spec(), tokens);
  absl::StatusOr<std::unique_ptr<AppendWriter>> writer =
      Cache::BeginAppend(cache, tokens, payload.size());
  ASSERT_TRUE(writer.ok());
  ASSERT_TRUE((*writer)->Write(absl::MakeConstSpan(payload).first(40)).ok());
  device.fail = true;
  EXPECT_TRUE(IsError((*writer)->Write(absl::MakeConstSpan(payload).subspan(40)),
                      absl::StatusCode::kDataLoss, {"as told"}));
  device.fail = false;
  EXPECT_TRUE(SameState(before, CaptureState(*cache)));
  EXPECT_TRUE(IsError((*writer)->Commit(), absl::StatusCode::kDataLoss, {"as told"}));
  // The cache is usable: nothing it stored was touched.
  EXPECT_TRUE(AppendRange(*cache, 0, 4, 12).ok());
  writer->reset();
}

// ---- Cache::AppendPieces: Append of a payload in the pieces a message arrived in -------------

// `payload` cut into pieces of `piece` bytes, with an empty piece between every two.
std::vector<absl::Span<const uint8_t>> Cut(const std::vector<uint8_t>& payload, size_t piece) {
  std::vector<absl::Span<const uint8_t>> pieces;
  for (size_t at = 0; at < payload.size(); at += piece) {
    if (!pieces.empty()) pieces.push_back(absl::Span<const uint8_t>());
    pieces.push_back(
        absl::MakeConstSpan(payload).subspan(at, std::min(piece, payload.size() - at)));
  }
  return pieces;
}

// Equal to Append of the whole payload on a twin, for every cut, whether the pieces go into the
// cells where they lie (Attention groups in host memory), or are gathered first (a cache that
// writes under its lock, or cells on a device); a sliding window prunes as Append prunes.
TEST(CacheAppendPiecesTest, EqualsAppendForEveryCut) {
  struct Case {
    const char* name;
    CacheSpec spec;
    int32_t stored;  // positions each sequence holds before
    int32_t end;     // the batch appends [stored, end) to each sequence
    int64_t seqs;    // sequences 0 .. seqs - 1, interleaved in the batch
    bool speculative;
  };
  for (const Case& c : {Case{"attention", AttentionSpec(), 3, 9, 2, false},
                        Case{"attention, speculative", AttentionSpec(), 3, 6, 2, true},
                        // 8 cells free, 16 needed: pruning positions below 8 gives the rest.
                        Case{"sliding, pruning", SlidingSpec(), 12, 28, 1, false},
                        Case{"hybrid", HybridSpec(), 3, 9, 2, false},
                        Case{"hybrid, speculative", HybridSpec(), 3, 6, 2, true}}) {
    std::vector<Token> batch;
    for (int32_t p = c.stored; p < c.end; ++p) {
      for (int64_t seq = 0; seq < c.seqs; ++seq) batch.push_back(Token{seq, p});
    }
    const std::vector<uint8_t> payload = PayloadFor(c.spec, batch, /*salt=*/11, c.speculative);
    for (size_t piece :
         {size_t{1}, size_t{3}, size_t{8}, size_t{17}, size_t{100}, payload.size()}) {
      SCOPED_TRACE(testing::Message() << c.name << ", pieces of " << piece);
      TestCache reference(c.spec);
      TestCache tc(c.spec);
      for (Cache* each : {reference.cache.get(), tc.cache.get()}) {
        for (int64_t seq = 0; seq < c.seqs; ++seq) {
          const absl::Status stored = AppendRange(*each, seq, 0, c.stored);
          ASSERT_TRUE(stored.ok()) << stored;
        }
      }
      const absl::Status appended = reference.cache->Append(batch, payload, c.speculative);
      ASSERT_TRUE(appended.ok()) << appended;
      const std::vector<absl::Span<const uint8_t>> pieces = Cut(payload, piece);
      const absl::Status in_pieces = tc.cache->AppendPieces(batch, pieces, c.speculative);
      ASSERT_TRUE(in_pieces.ok()) << in_pieces;
      EXPECT_TRUE(SameState(CaptureState(*reference.cache), CaptureState(*tc.cache)));
    }
  }
  // Only Attention groups in host memory take the pieces where they lie.
  const bool host = !testutil::TestOnCuda();
  EXPECT_EQ(TestCache(AttentionSpec()).cache->appends_pieces_in_place(), host);
  EXPECT_EQ(TestCache(SlidingSpec()).cache->appends_pieces_in_place(), host);
  EXPECT_FALSE(TestCache(HybridSpec()).cache->appends_pieces_in_place());
}

// Refused as Append refuses, with the payload's total size, and nothing changes.
TEST(CacheAppendPiecesTest, RefusesWhatAppendRefuses) {
  for (const CacheSpec& spec : {AttentionSpec(), HybridSpec()}) {
    TestCache tc(spec);
    ASSERT_TRUE(AppendRange(*tc.cache, 0, 0, 4).ok());
    const testutil::CacheState before = CaptureState(*tc.cache);
    const std::vector<Token> tokens = Tokens(0, 4, 8);
    std::vector<uint8_t> payload = PayloadFor(spec, tokens);
    payload.push_back(0);
    const std::string size = std::to_string(payload.size());
    EXPECT_TRUE(IsError(tc.cache->AppendPieces(tokens, Cut(payload, 5)),
                        absl::StatusCode::kInvalidArgument, {"payload is " + size + " bytes"}));
    payload.pop_back();
    // Positions it stores already.
    const std::vector<Token> stored = Tokens(0, 2, 6);
    EXPECT_TRUE(IsError(tc.cache->AppendPieces(stored, Cut(PayloadFor(spec, stored), 5)),
                        absl::StatusCode::kInvalidArgument, {}));
    EXPECT_TRUE(SameState(before, CaptureState(*tc.cache)));
    ASSERT_TRUE(tc.cache->AppendPieces(tokens, Cut(payload, 5)).ok());
  }
}

// A device error on any piece gives the Append's cells back: the cache is as before, and usable.
TEST(CacheAppendPiecesTest, ADeviceErrorLeavesTheCacheAsBefore) {
  FailingDevice device;
  absl::StatusOr<std::unique_ptr<Cache>> created = Cache::Create(AttentionSpec(), &device);
  ASSERT_TRUE(created.ok());
  Cache& cache = **created;
  ASSERT_TRUE(cache.appends_pieces_in_place());
  ASSERT_TRUE(AppendRange(cache, 0, 0, 4).ok());
  const testutil::CacheState before = CaptureState(cache);
  const std::vector<Token> tokens = Tokens(0, 4, 12);
  const std::vector<uint8_t> payload = PayloadFor(cache.spec(), tokens);
  device.fail = true;
  EXPECT_TRUE(IsError(cache.AppendPieces(tokens, Cut(payload, 40)), absl::StatusCode::kDataLoss,
                      {"as told"}));
  device.fail = false;
  EXPECT_TRUE(SameState(before, CaptureState(cache)));
  EXPECT_TRUE(cache.AppendPieces(tokens, Cut(payload, 40)).ok());
}

// A HostDevice that gives no host address: its cells count as a device's.
class OpaqueDevice : public HostDevice {
 public:
  OpaqueDevice() : HostDevice(size_t{1} << 26) {}
  const uint8_t* HostAddress(const DeviceArena& arena) const override { return nullptr; }
};

// Cells outside host memory take the pieces gathered into one buffer (once the cells are
// reserved), with the same outcome.
TEST(CacheAppendPiecesTest, CellsOutsideHostMemoryTakeThePiecesGathered) {
  OpaqueDevice device;
  absl::StatusOr<std::unique_ptr<Cache>> reference = Cache::Create(AttentionSpec(), &device);
  absl::StatusOr<std::unique_ptr<Cache>> created = Cache::Create(AttentionSpec(), &device);
  ASSERT_TRUE(reference.ok() && created.ok());
  Cache& cache = **created;
  EXPECT_FALSE(cache.appends_pieces_in_place());
  EXPECT_FALSE(cache.GathersPieces(1));
  EXPECT_TRUE(cache.GathersPieces(2));
  for (Cache* each : {reference->get(), &cache}) ASSERT_TRUE(AppendRange(*each, 0, 0, 4).ok());
  const std::vector<Token> tokens = Tokens(0, 4, 12);
  const std::vector<uint8_t> payload = PayloadFor(cache.spec(), tokens, /*salt=*/3);
  ASSERT_TRUE((*reference)->Append(tokens, payload).ok());
  const absl::Status appended = cache.AppendPieces(tokens, Cut(payload, 7));
  ASSERT_TRUE(appended.ok()) << appended;
  EXPECT_TRUE(SameState(CaptureState(**reference), CaptureState(cache)));
}

// The writer keeps its cache alive: a cache dropped by everything else meanwhile is deleted
// with the writer, its cells given back first.
TEST(CacheAppendWriterTest, TheWriterKeepsItsCacheAlive) {
  const CacheSpec spec = AttentionSpec();
  TestCache tc(spec);
  std::shared_ptr<Cache> cache = Shared(tc);
  const std::vector<Token> tokens = Tokens(0, 0, 3);
  const std::vector<uint8_t> payload = PayloadFor(spec, tokens);
  absl::StatusOr<std::unique_ptr<AppendWriter>> writer =
      Cache::BeginAppend(cache, tokens, payload.size());
  ASSERT_TRUE(writer.ok());
  std::weak_ptr<Cache> weak = cache;
  cache.reset();
  EXPECT_FALSE(weak.expired());
  ASSERT_TRUE((*writer)->Write(payload).ok());
  ASSERT_TRUE((*writer)->Commit().ok());
  EXPECT_TRUE(weak.lock()->IsLive(0));
  writer->reset();
  EXPECT_TRUE(weak.expired());
}

// Writers scatter into their cells without the cache's lock while other threads read, copy,
// append to and remove from the same cache: every Read sees whole committed rows (never a
// writer's half-written cells), copies carry the source's rows, and writers dropped before their
// commit leave nothing behind. Under TSan, any access to a writer's cells outside the writer is
// reported.
TEST(CacheAppendWriterTest, WritersRunBesideReadsCopiesAndOtherAppends) {
  const CacheSpec spec =
      Spec(DType::kF16, 8, 512, 32,
           {Group(Full(), 2, 2, 4, 2, Rope(RopeType::kNormal, 4)), Group(Full(), 1, 1, 4, 2)});
  TestCache tc(spec);
  std::shared_ptr<Cache> cache = Shared(tc);
  constexpr int32_t kLimit = 96;  // a sequence is truncated to empty before it grows past this
  std::atomic<int> failures{0};
  std::atomic<int64_t> commits{0};
  std::atomic<int64_t> drops{0};
  std::atomic<int64_t> checked_reads{0};
  // 2 s, and on until every kind of step ran a few times (a loaded machine gets fewer done), but
  // no longer than 120 s.
  const absl::Time start = absl::Now();
  auto running = [&] {
    if (failures != 0) return false;
    const absl::Duration elapsed = absl::Now() - start;
    if (elapsed < absl::Seconds(2)) return true;
    if (elapsed > absl::Seconds(120)) return false;
    return commits <= 10 || drops == 0 || checked_reads <= 10;
  };
  auto fail = [&](const std::string& what) {
    if (++failures <= 5) ADD_FAILURE() << what;
  };
  // Rows of `seq` (appended by `owner`) at positions [0, n) as read, checked against their ids.
  auto check = [&](int64_t seq, int64_t owner) {
    absl::StatusOr<ReadResult> read = cache->Read(seq, 0, std::nullopt);
    if (!read.ok()) return;  // NOT_FOUND: nothing stored at the moment
    const std::vector<int32_t>& got = read->positions[0];
    if (got != Range(0, static_cast<int32_t>(got.size())) || read->positions[1] != got) {
      fail(absl::StrCat("sequence ", seq, " holds positions ", ToString(got)));
      return;
    }
    const ::testing::AssertionResult same =
        MatchesRows(spec, read->payload, {Unshifted(owner, got), Unshifted(owner, got)});
    if (!same) fail(absl::StrCat("sequence ", seq, ": ", same.message()));
    ++checked_reads;
  };
  std::vector<std::thread> threads;
  for (int64_t seq : {0, 1}) {  // writers
    threads.emplace_back([&, seq] {
      std::mt19937 rng(static_cast<uint32_t>(seq) + 1);
      int32_t next = 0;
      while (running()) {
        const int32_t n = 1 + static_cast<int32_t>(rng() % 12);
        if (next + n > kLimit) {
          if (absl::Status s = cache->Remove(seq, 0, std::nullopt); !s.ok()) {
            fail(absl::StrCat("Remove: ", s.ToString()));
          }
          next = 0;
        }
        const std::vector<Token> tokens = Tokens(seq, next, next + n);
        const std::vector<uint8_t> payload = PayloadFor(spec, tokens);
        absl::StatusOr<std::unique_ptr<AppendWriter>> writer =
            Cache::BeginAppend(cache, tokens, payload.size());
        if (!writer.ok()) {
          fail(absl::StrCat("BeginAppend: ", writer.status().ToString()));
          continue;
        }
        if (!(*writer)->in_cells()) fail("the writer buffers");
        if (absl::Status s = WriteInPieces(**writer, payload, 1 + rng() % 200); !s.ok()) {
          fail(absl::StrCat("Write: ", s.ToString()));
          continue;
        }
        if (rng() % 8 == 0) {  // given up: its cells go back
          writer->reset();
          ++drops;
          continue;
        }
        if (absl::Status s = (*writer)->Commit(); !s.ok()) {
          fail(absl::StrCat("Commit: ", s.ToString()));
          continue;
        }
        ++commits;
        next += n;
      }
    });
  }
  threads.emplace_back([&] {  // unary Appends and truncations of sequence 2
    int32_t next = 0;
    while (running()) {
      if (next + 8 > kLimit) {
        if (absl::Status s = cache->Remove(2, 0, std::nullopt); !s.ok()) {
          fail(absl::StrCat("Remove 2: ", s.ToString()));
        }
        next = 0;
      }
      if (absl::Status s = AppendRange(*cache, 2, next, next + 8); !s.ok()) {
        fail(absl::StrCat("Append 2: ", s.ToString()));
      }
      next += 8;
    }
  });
  threads.emplace_back([&] {  // readers and copies of the writers' sequences
    int64_t i = 0;
    while (running()) {
      const int64_t src = i++ % 2;
      check(src, src);
      check(2, 2);
      // Sequence 3 becomes a copy of a prefix of the source (all of it, or less).
      absl::Status copied = cache->CopyPrefix(src, 3, static_cast<int32_t>(i % 40));
      if (!copied.ok()) fail(absl::StrCat("CopyPrefix: ", copied.ToString()));
      check(3, src);
    }
  });
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_GT(commits.load(), 10);
  EXPECT_GT(drops.load(), 0);
  EXPECT_GT(checked_reads.load(), 10);
  // Nothing a writer took is left over: the cells used are those the sequences store (some
  // shared by the copy).
  cache->Remove(3, 0, std::nullopt).IgnoreError();
  int64_t stored = 0;
  for (int64_t seq : {0, 1, 2}) {
    const std::vector<std::vector<int32_t>> positions = StoredPositions(*cache, seq);
    if (!positions.empty()) stored += static_cast<int64_t>(positions[0].size());
  }
  EXPECT_EQ(cache->Usage().groups[0].cells_used, stored);
  std::printf("writers beside other operations: %lld commits, %lld given up, %lld reads checked\n",
              static_cast<long long>(commits.load()), static_cast<long long>(drops.load()),
              static_cast<long long>(checked_reads.load()));
}

}  // namespace
}  // namespace kvmesh
