// Moving a sequence between caches without a snapshot copy (cache/cache.h "Moving a sequence
// between nodes without a snapshot copy"): Cache::OpenSequenceExport reads the wire image
// straight from pinned cells, and Cache::BeginSequenceImport / RestoreImport write it straight
// into free cells that the sequence then takes. Every image is compared with the one a snapshot
// gives, every restore with Restore of an imported snapshot in a twin cache, and the cells a
// transfer pins with what Usage and later operations see.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "cache/cache.h"
#include "gtest/gtest.h"
#include "tests/unit/cache_test_util.h"

namespace kvmesh {
namespace {

using testutil::AppendRange;
using testutil::AppendSpeculative;
using testutil::CacheState;
using testutil::CaptureState;
using testutil::Chunked;
using testutil::Full;
using testutil::Group;
using testutil::IsError;
using testutil::RecurrentGroup;
using testutil::Rope;
using testutil::SameState;
using testutil::Sliding;
using testutil::Spec;
using testutil::TestCache;

using Image = std::vector<uint8_t>;
constexpr auto kNoEnd = std::nullopt;
constexpr size_t kWhole = SIZE_MAX;

// A cache held as a node holds it (OpenSequenceExport keeps it alive through a shared_ptr).
struct SharedCache {
  explicit SharedCache(const CacheSpec& spec) {
    TestCache made(spec);
    device = std::move(made.device);
    cache = std::move(made.cache);
  }
  std::unique_ptr<Device> device;  // declared first: outlives the cache
  std::shared_ptr<Cache> cache;
};

absl::StatusOr<Image> ReadImage(SnapshotExportReader& reader) {
  Image image(reader.size());
  const absl::Status read = reader.ReadAt(0, absl::MakeSpan(image));
  if (!read.ok()) return read;
  return image;
}

// The image of Snapshot(seq, from, to), the snapshot dropped again.
absl::StatusOr<Image> SnapshotImage(Cache& cache, int64_t seq, int32_t from,
                                    std::optional<int32_t> to) {
  absl::StatusOr<SnapshotInfo> snap = cache.Snapshot(seq, from, to);
  if (!snap.ok()) return snap.status();
  absl::StatusOr<std::unique_ptr<SnapshotExportReader>> reader = cache.OpenSnapshotExport(snap->id);
  (void)cache.DropSnapshot(snap->id);
  if (!reader.ok()) return reader.status();
  return ReadImage(**reader);
}

absl::StatusOr<Image> SequenceImage(const std::shared_ptr<Cache>& cache, int64_t seq, int32_t from,
                                    std::optional<int32_t> to) {
  absl::StatusOr<std::unique_ptr<SnapshotExportReader>> reader =
      Cache::OpenSequenceExport(cache, seq, from, to);
  if (!reader.ok()) return reader.status();
  return ReadImage(**reader);
}

// Writes `image` in pieces of `piece` bytes and commits.
absl::StatusOr<std::unique_ptr<SequenceImport>> Import(const std::shared_ptr<Cache>& cache,
                                                       const Image& image, size_t piece = kWhole) {
  absl::StatusOr<std::unique_ptr<SequenceImport>> import =
      Cache::BeginSequenceImport(cache, image.size());
  if (!import.ok()) return import.status();
  for (size_t at = 0; at < image.size();) {
    const size_t n = std::min(piece, image.size() - at);
    const absl::Status written = (*import)->Write(absl::MakeConstSpan(image).subspan(at, n));
    if (!written.ok()) return written;
    at += n;
  }
  absl::StatusOr<SnapshotInfo> committed = (*import)->Commit();
  if (!committed.ok()) return committed.status();
  return import;
}

int64_t CellsUsed(const Cache& cache) {
  int64_t used = 0;
  for (const GroupUsage& g : cache.Usage().groups) used += g.cells_used;
  return used;
}

// Two sequences appended in turns (their cells interleave), one with a gap and a shared prefix
// copied into a third: runs of every length.
void Fragment(Cache& cache) {
  for (int32_t p = 0; p < 12; p += 3) {
    ASSERT_TRUE(AppendRange(cache, 0, p, p + 3).ok());
    ASSERT_TRUE(AppendRange(cache, 1, p, p + 1).ok());
  }
  ASSERT_TRUE(cache.Remove(0, 4, 6).ok());  // context shift: positions 6.. move down by 2
  ASSERT_TRUE(cache.CopyPrefix(0, 2, 5).ok());
  ASSERT_TRUE(AppendRange(cache, 2, 5, 9).ok());
}

CacheSpec AttentionSpec(const WindowSpec& window) {
  return Spec(DType::kF16, 4, 40, 8, {Group(window, 2, 2, 4, 6, Rope(RopeType::kNeox, 4))});
}

TEST(SequenceExportTest, TheImageIsTheSnapshotsByteForByte) {
  for (const WindowSpec& window : {Full(), Sliding(4, 6), Chunked(8)}) {
    SCOPED_TRACE(::testing::Message() << "window kind " << static_cast<int>(window.kind));
    SharedCache src(AttentionSpec(window));
    ASSERT_NE(src.cache, nullptr);
    ASSERT_TRUE(src.cache->lends_cells());
    Fragment(*src.cache);
    const struct {
      int64_t seq;
      int32_t from;
      std::optional<int32_t> to;
    } cases[] = {{0, 0, kNoEnd}, {0, 0, 5}, {0, 3, 9}, {1, 0, kNoEnd}, {2, 0, kNoEnd}, {2, 4, 6}};
    for (const auto& c : cases) {
      SCOPED_TRACE(::testing::Message() << "seq " << c.seq << " from " << c.from << " to "
                                        << (c.to.has_value() ? *c.to : -1));
      absl::StatusOr<Image> expected = SnapshotImage(*src.cache, c.seq, c.from, c.to);
      absl::StatusOr<Image> image = SequenceImage(src.cache, c.seq, c.from, c.to);
      ASSERT_EQ(expected.status().code(), image.status().code()) << image.status();
      if (expected.ok()) {
        EXPECT_TRUE(*image == *expected);
      }
    }
    // Views, where the device has host memory, are the ReadAt bytes.
    absl::StatusOr<std::unique_ptr<SnapshotExportReader>> reader =
        Cache::OpenSequenceExport(src.cache, 0, 0, kNoEnd);
    ASSERT_TRUE(reader.ok()) << reader.status();
    absl::StatusOr<Image> image = ReadImage(**reader);
    ASSERT_TRUE(image.ok());
    for (size_t at = 0; at < image->size();) {
      const absl::Span<const uint8_t> view = (*reader)->View(at, 1000);
      if (view.empty()) break;  // not in host memory
      ASSERT_TRUE(std::equal(view.begin(), view.end(), image->begin() + at)) << "at " << at;
      at += view.size();
    }
    EXPECT_TRUE(src.cache->ListSnapshots().empty());
    // The cells' bytes count as pinned by the export, until the reader goes.
    EXPECT_EQ(src.cache->Usage().export_bytes, (*reader)->info().bytes);
    EXPECT_GT((*reader)->info().bytes, 0u);
    reader->reset();
    EXPECT_EQ(src.cache->Usage().export_bytes, 0u);
  }
}

TEST(SequenceExportTest, RefusesAsSnapshotDoes) {
  SharedCache src(AttentionSpec(Full()));
  ASSERT_TRUE(AppendRange(*src.cache, 0, 0, 4).ok());
  const CacheState before = CaptureState(*src.cache);
  EXPECT_TRUE(IsError(Cache::OpenSequenceExport(src.cache, 7, 0, kNoEnd).status(),
                      absl::StatusCode::kNotFound, {"no sequence 7"}));
  EXPECT_TRUE(IsError(Cache::OpenSequenceExport(src.cache, -1, 0, kNoEnd).status(),
                      absl::StatusCode::kInvalidArgument, {"seq"}));
  EXPECT_TRUE(IsError(Cache::OpenSequenceExport(src.cache, 0, 4, kNoEnd).status(),
                      absl::StatusCode::kFailedPrecondition, {"from_offset = 4"}));
  EXPECT_TRUE(IsError(Cache::OpenSequenceExport(src.cache, 0, 2, 2).status(),
                      absl::StatusCode::kInvalidArgument, {"to = 2"}));
  EXPECT_TRUE(SameState(before, CaptureState(*src.cache)));
}

TEST(SequenceExportTest, PinnedCellsAreNeitherFreedNorRewritten) {
  // 16 cells (max_sequences x capacity): sequence 0 holds 8 of them, and the reader pins those.
  const CacheSpec spec =
      Spec(DType::kF16, 2, 8, 8, {Group(Full(), 2, 2, 4, 6, Rope(RopeType::kNeox, 4))});
  SharedCache src(spec);
  SharedCache twin(spec);  // the same operations without a pin
  for (Cache* c : {src.cache.get(), twin.cache.get()}) ASSERT_TRUE(AppendRange(*c, 0, 0, 8).ok());
  absl::StatusOr<std::unique_ptr<SnapshotExportReader>> reader =
      Cache::OpenSequenceExport(src.cache, 0, 0, kNoEnd);
  ASSERT_TRUE(reader.ok()) << reader.status();
  const absl::StatusOr<Image> image = ReadImage(**reader);
  ASSERT_TRUE(image.ok());

  // A context shift rotates copies of the pinned cells: the sequence reads as in the twin.
  for (Cache* c : {src.cache.get(), twin.cache.get()}) ASSERT_TRUE(c->Remove(0, 1, 3).ok());
  const CacheState shifted = CaptureState(*twin.cache);
  const CacheState pinned = CaptureState(*src.cache);
  EXPECT_EQ(shifted.positions, pinned.positions);
  EXPECT_TRUE(shifted.payloads == pinned.payloads);
  EXPECT_EQ(CellsUsed(*twin.cache), 6);
  EXPECT_EQ(CellsUsed(*src.cache), 8 + 5);  // the 8 pinned, and copies of the 5 shifted

  // Gone from every sequence, the pinned cells stay used, and no Append gets them.
  ASSERT_TRUE(src.cache->Remove(0, 0, kNoEnd).ok());
  EXPECT_EQ(CellsUsed(*src.cache), 8);
  ASSERT_TRUE(AppendRange(*src.cache, 1, 0, 8).ok());
  const CacheState full = CaptureState(*src.cache);
  EXPECT_TRUE(IsError(AppendRange(*src.cache, 1, 8, 9), absl::StatusCode::kResourceExhausted,
                      {"free cells"}));
  EXPECT_TRUE(SameState(full, CaptureState(*src.cache)));
  absl::StatusOr<Image> again = ReadImage(**reader);
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(*again == *image);

  // The last reference gone, the cells are free.
  reader->reset();
  EXPECT_EQ(CellsUsed(*src.cache), 8);
  EXPECT_TRUE(AppendRange(*src.cache, 2, 0, 8).ok());
}

TEST(SequenceExportTest, AContextShiftThatNeedsCopiesOfPinnedCellsMayFindNoRoom) {
  const CacheSpec spec =  // 8 cells
      Spec(DType::kF16, 1, 8, 8, {Group(Full(), 1, 1, 4, 4, Rope(RopeType::kNeox, 4))});
  SharedCache src(spec);
  ASSERT_TRUE(AppendRange(*src.cache, 0, 0, 8).ok());
  absl::StatusOr<std::unique_ptr<SnapshotExportReader>> reader =
      Cache::OpenSequenceExport(src.cache, 0, 0, kNoEnd);
  ASSERT_TRUE(reader.ok());
  // Removing [0, 2) frees no cell (both are pinned) and the 6 shifted need copies.
  const CacheState before = CaptureState(*src.cache);
  EXPECT_TRUE(IsError(src.cache->Remove(0, 0, 2), absl::StatusCode::kResourceExhausted,
                      {"shared with other sequences"}));
  EXPECT_TRUE(SameState(before, CaptureState(*src.cache)));
  reader->reset();
  EXPECT_TRUE(src.cache->Remove(0, 0, 2).ok());
}

TEST(SequenceExportTest, SlidingPruningDoesNotCountPinnedCellsAsFreed) {
  // One sequence, a batch of one: max_sequences x memory + max_batch cells, all used once the
  // sequence holds that many positions; the next Append prunes its oldest to make room.
  const CacheSpec spec = Spec(DType::kF16, 1, 8, 1, {Group(Sliding(2, 2), 1, 1, 4, 4)});
  SharedCache src(spec);
  const int64_t total = src.cache->Usage().groups[0].cells_total;
  int32_t next = 0;
  while (CellsUsed(*src.cache) < total) {
    ASSERT_TRUE(AppendRange(*src.cache, 0, next, next + 1).ok());
    ++next;
  }
  absl::StatusOr<std::unique_ptr<SnapshotExportReader>> reader =
      Cache::OpenSequenceExport(src.cache, 0, 0, kNoEnd);
  ASSERT_TRUE(reader.ok());
  // Pinned, the cells pruning would drop stay used: no room.
  const CacheState before = CaptureState(*src.cache);
  EXPECT_TRUE(IsError(AppendRange(*src.cache, 0, next, next + 1),
                      absl::StatusCode::kResourceExhausted, {"free cells"}));
  EXPECT_TRUE(SameState(before, CaptureState(*src.cache)));
  reader->reset();
  EXPECT_TRUE(AppendRange(*src.cache, 0, next, next + 1).ok());
}

// Imports `image` into `dst` as a SequenceImport and into `twin` as a snapshot, restores both
// into `seq` with `target`: the same status and the same cache.
void ExpectSameRestore(const Image& image, const std::shared_ptr<Cache>& dst, Cache& twin,
                       int64_t seq, int32_t target, bool in_cells, size_t piece = kWhole) {
  absl::StatusOr<std::unique_ptr<SequenceImport>> import = Import(dst, image, piece);
  ASSERT_TRUE(import.ok()) << import.status();
  EXPECT_EQ((*import)->in_cells(), in_cells);
  absl::StatusOr<std::unique_ptr<SnapshotImportWriter>> writer =
      twin.BeginSnapshotImport(image.size());
  ASSERT_TRUE(writer.ok());
  ASSERT_TRUE((*writer)->Write(image).ok());
  absl::StatusOr<SnapshotInfo> snap = (*writer)->Commit();
  ASSERT_TRUE(snap.ok()) << snap.status();
  const absl::Status restored = dst->RestoreImport(seq, **import, target);
  const absl::Status expected = twin.Restore(seq, snap->id, target);
  ASSERT_TRUE(twin.DropSnapshot(snap->id).ok());
  EXPECT_EQ(restored.code(), expected.code()) << restored << " vs " << expected;
  import->reset();
  EXPECT_TRUE(SameState(CaptureState(twin), CaptureState(*dst)));
}

TEST(SequenceImportTest, RestoresWhatASnapshotRestoreWould) {
  for (const WindowSpec& window : {Full(), Sliding(4, 6), Chunked(8)}) {
    SCOPED_TRACE(::testing::Message() << "window kind " << static_cast<int>(window.kind));
    const CacheSpec spec = AttentionSpec(window);
    SharedCache src(spec);
    Fragment(*src.cache);
    for (int64_t seq : {0, 1, 2}) {
      absl::StatusOr<Image> image = SequenceImage(src.cache, seq, 0, kNoEnd);
      ASSERT_TRUE(image.ok()) << image.status();
      const int32_t to = src.cache->GetSequence(seq)->offset;
      for (int32_t target : {to, to / 2, 0}) {
        // More piece sizes only once per window: each case makes two caches, which is slow on
        // the simulated GPU.
        std::vector<size_t> pieces = {kWhole, size_t{7}};
        if (seq == 0 && target == to) pieces.insert(pieces.end(), {size_t{1}, size_t{100}});
        for (size_t piece : pieces) {
          SCOPED_TRACE(::testing::Message()
                       << "seq " << seq << " target " << target << " piece " << piece);
          SharedCache dst(spec);
          SharedCache twin(spec);
          // The destination holds something already, and another sequence shares it.
          for (Cache* c : {dst.cache.get(), twin.cache.get()}) {
            ASSERT_TRUE(AppendRange(*c, 3, 0, 5).ok());
            ASSERT_TRUE(c->CopyPrefix(3, 1, 3).ok());
          }
          ExpectSameRestore(*image, dst.cache, *twin.cache, 3, target, /*in_cells=*/true, piece);
        }
      }
    }
  }
}

TEST(SequenceImportTest, TooFewFreeCellsGoThroughTheSnapshotPool) {
  // 16 cells, 12 held by the destination itself: an image of 8 rows finds 4 free, so it is
  // received as a snapshot, and the restore reuses the destination's own cells.
  const CacheSpec spec = Spec(DType::kF16, 1, 16, 16, {Group(Full(), 1, 1, 4, 4)});
  SharedCache src(spec);
  ASSERT_TRUE(AppendRange(*src.cache, 0, 0, 8).ok());
  absl::StatusOr<Image> image = SequenceImage(src.cache, 0, 0, kNoEnd);
  ASSERT_TRUE(image.ok());
  SharedCache dst(spec);
  SharedCache twin(spec);
  for (Cache* c : {dst.cache.get(), twin.cache.get()}) ASSERT_TRUE(AppendRange(*c, 2, 0, 12).ok());
  ExpectSameRestore(*image, dst.cache, *twin.cache, 2, 8, /*in_cells=*/false);
  EXPECT_EQ(CellsUsed(*dst.cache), 8);
}

TEST(SequenceImportTest, AnImportGoneWithoutRestoreLeavesNothing) {
  const CacheSpec spec = AttentionSpec(Full());
  SharedCache src(spec);
  Fragment(*src.cache);
  absl::StatusOr<Image> image = SequenceImage(src.cache, 0, 0, kNoEnd);
  ASSERT_TRUE(image.ok());
  SharedCache dst(spec);
  ASSERT_TRUE(AppendRange(*dst.cache, 1, 0, 3).ok());
  const CacheState before = CaptureState(*dst.cache);
  {  // committed
    absl::StatusOr<std::unique_ptr<SequenceImport>> import = Import(dst.cache, *image);
    ASSERT_TRUE(import.ok());
    EXPECT_GT(CellsUsed(*dst.cache), 3);
  }
  EXPECT_TRUE(SameState(before, CaptureState(*dst.cache)));
  {  // half written
    absl::StatusOr<std::unique_ptr<SequenceImport>> import =
        Cache::BeginSequenceImport(dst.cache, image->size());
    ASSERT_TRUE(import.ok());
    ASSERT_TRUE((*import)->Write(absl::MakeConstSpan(*image).first(image->size() / 2)).ok());
    EXPECT_TRUE((*import)->in_cells());
    EXPECT_TRUE(IsError((*import)->Commit().status(), absl::StatusCode::kFailedPrecondition,
                        {"incomplete"}));
  }
  EXPECT_TRUE(SameState(before, CaptureState(*dst.cache)));
  {  // a refused header
    Image bad = *image;
    bad[0] ^= 1;
    absl::StatusOr<std::unique_ptr<SequenceImport>> import =
        Cache::BeginSequenceImport(dst.cache, bad.size());
    ASSERT_TRUE(import.ok());
    EXPECT_TRUE(IsError((*import)->Write(bad), absl::StatusCode::kInvalidArgument, {"magic"}));
  }
  EXPECT_TRUE(SameState(before, CaptureState(*dst.cache)));
}

TEST(SequenceImportTest, RestoreImportRefusals) {
  const CacheSpec spec = AttentionSpec(Full());
  SharedCache src(spec);
  ASSERT_TRUE(AppendRange(*src.cache, 0, 0, 6).ok());
  absl::StatusOr<Image> image = SequenceImage(src.cache, 0, 0, kNoEnd);
  ASSERT_TRUE(image.ok());
  SharedCache dst(spec);
  SharedCache other(spec);
  ASSERT_TRUE(AppendRange(*dst.cache, 1, 0, 3).ok());
  const CacheState before = CaptureState(*dst.cache);

  absl::StatusOr<std::unique_ptr<SequenceImport>> uncommitted =
      Cache::BeginSequenceImport(dst.cache, image->size());
  ASSERT_TRUE(uncommitted.ok());
  EXPECT_TRUE(IsError(dst.cache->RestoreImport(2, **uncommitted, 6),
                      absl::StatusCode::kFailedPrecondition, {"not committed"}));
  uncommitted->reset();

  absl::StatusOr<std::unique_ptr<SequenceImport>> import = Import(dst.cache, *image);
  ASSERT_TRUE(import.ok());
  EXPECT_TRUE(IsError(other.cache->RestoreImport(2, **import, 6),
                      absl::StatusCode::kFailedPrecondition, {"another cache"}));
  EXPECT_TRUE(IsError(dst.cache->RestoreImport(-2, **import, 6), absl::StatusCode::kInvalidArgument,
                      {"seq"}));
  // Refused by Restore's own checks: no sequence changes, and the import can still be restored.
  EXPECT_TRUE(IsError(dst.cache->RestoreImport(2, **import, 7),
                      absl::StatusCode::kFailedPrecondition,
                      {"target = 7", "the imported sequence"}));
  const CacheState refused = CaptureState(*dst.cache);
  EXPECT_EQ(refused.positions, before.positions);
  EXPECT_TRUE(refused.payloads == before.payloads);
  const absl::Status ok = dst.cache->RestoreImport(2, **import, 6);
  EXPECT_TRUE(ok.ok()) << ok;
  EXPECT_TRUE(IsError(dst.cache->RestoreImport(2, **import, 6),
                      absl::StatusCode::kFailedPrecondition, {"was used"}));
  absl::StatusOr<ReadResult> restored = dst.cache->Read(2, 0, kNoEnd);
  absl::StatusOr<ReadResult> source = src.cache->Read(0, 0, kNoEnd);
  ASSERT_TRUE(restored.ok() && source.ok());
  EXPECT_TRUE(restored->payload == source->payload);
  import->reset();  // used up: nothing left to free
  EXPECT_EQ(CellsUsed(*dst.cache), 3 + 6);
}

TEST(SequenceTransferTest, ACacheWithoutCellsForEveryGroupCopiesBothWays) {
  const CacheSpec spec =
      Spec(DType::kF32, 4, 16, 8, {Group(Full(), 1, 1, 4, 4), RecurrentGroup(1, 2, 3, 2, 2, 2)});
  SharedCache src(spec);
  ASSERT_FALSE(src.cache->lends_cells());
  ASSERT_TRUE(AppendRange(*src.cache, 0, 0, 5).ok());
  absl::StatusOr<Image> expected = SnapshotImage(*src.cache, 0, 0, kNoEnd);
  absl::StatusOr<Image> image = SequenceImage(src.cache, 0, 0, kNoEnd);
  ASSERT_TRUE(image.ok()) << image.status();
  EXPECT_TRUE(*image == *expected);
  EXPECT_TRUE(src.cache->ListSnapshots().empty());
  SharedCache dst(spec);
  SharedCache twin(spec);
  ExpectSameRestore(*image, dst.cache, *twin.cache, 2, 5, /*in_cells=*/false);
}

// ---- OpenRead ----------------------------------------------------------------------------

// The payload of `cursor`, read in pieces of `piece` bytes.
absl::StatusOr<std::string> CursorPayload(ReadCursor& cursor, size_t piece) {
  std::string payload(cursor.size(), '\0');
  for (size_t at = 0; at < payload.size();) {
    const size_t n = std::min(piece, payload.size() - at);
    const absl::Status read =
        cursor.ReadAt(at, absl::MakeSpan(reinterpret_cast<uint8_t*>(payload.data()) + at, n));
    if (!read.ok()) return read;
    at += n;
  }
  return payload;
}

// OpenRead gives what Read gives, with the same status.
::testing::AssertionResult SameAsRead(const std::shared_ptr<Cache>& cache, int64_t seq,
                                      int32_t begin, std::optional<int32_t> end, size_t piece) {
  absl::StatusOr<ReadResult> expected = cache->Read(seq, begin, end);
  absl::StatusOr<std::unique_ptr<ReadCursor>> cursor = Cache::OpenRead(cache, seq, begin, end);
  if (expected.status().code() != cursor.status().code()) {
    return ::testing::AssertionFailure() << expected.status() << " vs " << cursor.status();
  }
  if (!expected.ok()) {
    if (expected.status().message() != cursor.status().message()) {
      return ::testing::AssertionFailure() << expected.status() << " vs " << cursor.status();
    }
    return ::testing::AssertionSuccess();
  }
  if ((*cursor)->header().positions != expected->positions ||
      (*cursor)->header().states != expected->states) {
    return ::testing::AssertionFailure() << "positions or states differ";
  }
  absl::StatusOr<std::string> payload = CursorPayload(**cursor, piece);
  if (!payload.ok()) return ::testing::AssertionFailure() << payload.status();
  if (*payload != expected->payload) return ::testing::AssertionFailure() << "payload differs";
  return ::testing::AssertionSuccess();
}

TEST(OpenReadTest, GivesWhatReadGives) {
  for (const WindowSpec& window : {Full(), Sliding(4, 6), Chunked(8)}) {
    SCOPED_TRACE(::testing::Message() << "window kind " << static_cast<int>(window.kind));
    SharedCache c(AttentionSpec(window));
    Fragment(*c.cache);
    const absl::Status pending = AppendSpeculative(*c.cache, 1, 10, 12);  // read too
    ASSERT_TRUE(pending.ok()) << pending;
    const struct {
      int64_t seq;
      int32_t begin;
      std::optional<int32_t> end;
    } cases[] = {{0, 0, kNoEnd},  {0, 2, 7},       {0, 5, 5},  {0, 30, kNoEnd},
                 {1, 0, kNoEnd},  {1, 3, 5},       {2, 0, 20}, {7, 0, kNoEnd},
                 {-1, 0, kNoEnd}, {0, -1, kNoEnd}, {0, 4, 2}};
    for (const auto& r : cases) {
      for (size_t piece : {size_t{1}, size_t{7}, size_t{4096}, kWhole}) {
        SCOPED_TRACE(::testing::Message()
                     << "seq " << r.seq << " [" << r.begin << ", "
                     << (r.end.has_value() ? *r.end : -1) << ") piece " << piece);
        EXPECT_TRUE(SameAsRead(c.cache, r.seq, r.begin, r.end, piece));
      }
    }
  }
  // A cache that does not lend cells reads at once, the same.
  const CacheSpec hybrid =
      Spec(DType::kF32, 4, 16, 8, {Group(Full(), 1, 1, 4, 4), RecurrentGroup(1, 2, 3, 2, 2, 2)});
  SharedCache h(hybrid);
  ASSERT_TRUE(AppendRange(*h.cache, 0, 0, 5).ok());
  EXPECT_TRUE(SameAsRead(h.cache, 0, 0, kNoEnd, 3));
  EXPECT_TRUE(SameAsRead(h.cache, 0, 2, 4, 3));
  EXPECT_TRUE(SameAsRead(h.cache, 3, 0, kNoEnd, 3));
}

TEST(OpenReadTest, TheCursorReadsTheSequenceAsItWasWhenOpened) {
  const CacheSpec spec =
      Spec(DType::kF16, 2, 8, 8, {Group(Full(), 2, 2, 4, 6, Rope(RopeType::kNeox, 4))});
  SharedCache c(spec);
  ASSERT_TRUE(AppendRange(*c.cache, 0, 0, 8).ok());
  absl::StatusOr<ReadResult> before = c.cache->Read(0, 0, kNoEnd);
  ASSERT_TRUE(before.ok());
  absl::StatusOr<std::unique_ptr<ReadCursor>> cursor = Cache::OpenRead(c.cache, 0, 0, kNoEnd);
  ASSERT_TRUE(cursor.ok());
  // Shifted, removed, and its cells wanted by another sequence: the cursor's bytes stay.
  ASSERT_TRUE(c.cache->Remove(0, 0, 3).ok());
  ASSERT_TRUE(c.cache->Remove(0, 0, kNoEnd).ok());
  ASSERT_TRUE(AppendRange(*c.cache, 1, 0, 8).ok());
  EXPECT_TRUE(IsError(AppendRange(*c.cache, 1, 8, 9), absl::StatusCode::kResourceExhausted,
                      {"free cells"}));
  absl::StatusOr<std::string> payload = CursorPayload(**cursor, 1000);
  ASSERT_TRUE(payload.ok());
  EXPECT_TRUE(*payload == before->payload);
  EXPECT_EQ((*cursor)->header().positions, before->positions);
  uint8_t byte = 0;
  EXPECT_TRUE((*cursor)->ReadAt((*cursor)->size(), absl::MakeSpan(&byte, 0)).ok());
  EXPECT_TRUE(IsError((*cursor)->ReadAt((*cursor)->size(), absl::MakeSpan(&byte, 1)),
                      absl::StatusCode::kOutOfRange, {"goes past the end"}));
  cursor->reset();
  EXPECT_EQ(CellsUsed(*c.cache), 8);
  EXPECT_TRUE(AppendRange(*c.cache, 0, 0, 8).ok());
}

TEST(SequenceTransferConcurrencyTest, PinnedReadsExportsAndImportsBesideOtherOperations) {
  // Sequence 0 never changes; sequence 1's cells come and go, sequence 3 shares sequence 0's
  // cells and is context-shifted and copied again. Readers of sequence 0 (cursors, exports
  // imported into a second cache) must see its bytes, whatever the others do meanwhile.
  const CacheSpec spec =
      Spec(DType::kF16, 4, 32, 8, {Group(Full(), 2, 2, 4, 6, Rope(RopeType::kNeox, 4))});
  SharedCache src(spec);
  SharedCache dst(spec);
  for (int32_t p = 0; p < 16; p += 8) ASSERT_TRUE(AppendRange(*src.cache, 0, p, p + 8).ok());
  const absl::StatusOr<ReadResult> expected = src.cache->Read(0, 0, kNoEnd);
  ASSERT_TRUE(expected.ok());
  std::atomic<bool> stop{false};
  std::atomic<int> wrong{0};
  std::vector<std::thread> threads;
  threads.emplace_back([&] {  // cursors
    while (!stop.load()) {
      absl::StatusOr<std::unique_ptr<ReadCursor>> cursor = Cache::OpenRead(src.cache, 0, 0, kNoEnd);
      if (!cursor.ok()) {
        ++wrong;
        continue;
      }
      absl::StatusOr<std::string> payload = CursorPayload(**cursor, 333);
      if (!payload.ok() || *payload != expected->payload) ++wrong;
    }
  });
  threads.emplace_back([&] {  // exports imported into dst
    while (!stop.load()) {
      absl::StatusOr<Image> image = SequenceImage(src.cache, 0, 0, kNoEnd);
      if (!image.ok()) {
        ++wrong;
        continue;
      }
      absl::StatusOr<std::unique_ptr<SequenceImport>> import = Import(dst.cache, *image, 1000);
      if (!import.ok() || !dst.cache->RestoreImport(2, **import, 16).ok()) {
        ++wrong;
        continue;
      }
      absl::StatusOr<ReadResult> read = dst.cache->Read(2, 0, kNoEnd);
      if (!read.ok() || read->payload != expected->payload) ++wrong;
    }
  });
  threads.emplace_back([&] {  // churn: cells freed and taken again
    while (!stop.load()) {
      (void)AppendRange(*src.cache, 1, 0, 8);
      (void)src.cache->Remove(1, 0, kNoEnd);
    }
  });
  threads.emplace_back([&] {  // shares sequence 0's cells, then rotates copies of them
    while (!stop.load()) {
      (void)src.cache->CopyPrefix(0, 3, 16);
      (void)src.cache->Remove(3, 0, 4);
    }
  });
  absl::SleepFor(absl::Seconds(2));
  stop.store(true);
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(wrong.load(), 0);
  // Every pin is gone: only sequences 0, 1 (maybe) and 3 hold cells.
  ASSERT_TRUE(src.cache->Remove(1, 0, kNoEnd).ok());
  ASSERT_TRUE(src.cache->Remove(3, 0, kNoEnd).ok());
  EXPECT_EQ(CellsUsed(*src.cache), 16);
  EXPECT_EQ(src.cache->Usage().export_bytes, 0u);
  const absl::StatusOr<ReadResult> after = src.cache->Read(0, 0, kNoEnd);
  ASSERT_TRUE(after.ok());
  EXPECT_TRUE(after->payload == expected->payload);
}

}  // namespace
}  // namespace kvmesh
