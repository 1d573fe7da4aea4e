// Moving snapshots between caches (docs/cluster.md "The unit of transfer"; the wire image in
// cache/snapshot_wire.h): Cache::OpenSnapshotExport and Cache::BeginSnapshotImport. Every
// round trip goes from a cache on one device to a cache on a second device (a TestCache each)
// and checks that restoring the imported snapshot gives exactly what restoring the original
// gives in the source cache. Malformed images give the exact status code and name the field.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "cache/cache.h"
#include "cache/snapshot_wire.h"
#include "gtest/gtest.h"
#include "tests/unit/cache_test_util.h"

namespace kvmesh {
namespace {

using testutil::AppendRange;
using testutil::AppendTokens;
using testutil::Chunked;
using testutil::FindSequence;
using testutil::Full;
using testutil::Group;
using testutil::Ids;
using testutil::IsError;
using testutil::Range;
using testutil::ReadIs;
using testutil::RecurrentGroup;
using testutil::Rope;
using testutil::RotatingGroup;
using testutil::SameBytes;
using testutil::Sliding;
using testutil::Spec;
using testutil::StateId;
using testutil::TestCache;

using Image = std::vector<uint8_t>;
constexpr auto kNoEnd = std::nullopt;
constexpr size_t kWhole = SIZE_MAX;  // write the image in one piece
constexpr DType kDTypes[] = {DType::kF32, DType::kF16, DType::kBF16};

// ---- Helpers --------------------------------------------------------------------------------

absl::StatusOr<Image> ExportImage(const Cache& cache, uint64_t id) {
  absl::StatusOr<std::unique_ptr<SnapshotExportReader>> reader = cache.OpenSnapshotExport(id);
  if (!reader.ok()) return reader.status();
  Image image((*reader)->size());
  const absl::Status read = (*reader)->ReadAt(0, absl::MakeSpan(image));
  if (!read.ok()) return read;
  return image;
}

// Writes `image` in pieces of `piece` bytes (the last may be shorter), then commits.
absl::StatusOr<SnapshotInfo> ImportImage(Cache& cache, const Image& image, size_t piece = kWhole) {
  absl::StatusOr<std::unique_ptr<SnapshotImportWriter>> writer =
      cache.BeginSnapshotImport(image.size());
  if (!writer.ok()) return writer.status();
  for (size_t at = 0; at < image.size();) {
    const size_t n = std::min(piece, image.size() - at);
    const absl::Status written = (*writer)->Write(absl::MakeConstSpan(image).subspan(at, n));
    if (!written.ok()) return written;
    at += n;
    if ((*writer)->written() != at) {
      return absl::InternalError("written() does not count the bytes written");
    }
  }
  return (*writer)->Commit();
}

std::optional<SnapshotInfo> FindSnapshot(const Cache& cache, uint64_t id) {
  for (const SnapshotInfo& info : cache.ListSnapshots()) {
    if (info.id == id) return info;
  }
  return std::nullopt;
}

// Everything but the id.
::testing::AssertionResult SameInfo(const SnapshotInfo& a, const SnapshotInfo& b) {
  if (a.seq != b.seq || a.from != b.from || a.to != b.to || a.bytes != b.bytes ||
      a.groups.size() != b.groups.size()) {
    return ::testing::AssertionFailure()
           << "seq " << a.seq << "/" << b.seq << " [" << a.from << ", " << a.to << ") / [" << b.from
           << ", " << b.to << ") bytes " << a.bytes << "/" << b.bytes << " groups "
           << a.groups.size() << "/" << b.groups.size();
  }
  for (size_t g = 0; g < a.groups.size(); ++g) {
    const SnapshotGroupInfo& x = a.groups[g];
    const SnapshotGroupInfo& y = b.groups[g];
    if (x.stored != y.stored || x.ring_index != y.ring_index || x.state != y.state) {
      return ::testing::AssertionFailure()
             << "group " << g << ": stored " << x.stored << "/" << y.stored << " ring_index "
             << x.ring_index << "/" << y.ring_index << " state " << StateStatusName(x.state) << "/"
             << StateStatusName(y.state);
    }
  }
  return ::testing::AssertionSuccess();
}

// Exports snapshot `id` of `src` and imports it into `dst` in pieces of `piece` bytes; the new
// snapshot's info, returned and listed, equals the original's but for the id.
::testing::AssertionResult Transfer(const Cache& src, uint64_t id, Cache& dst, uint64_t* dst_id,
                                    size_t piece = kWhole) {
  absl::StatusOr<Image> image = ExportImage(src, id);
  if (!image.ok()) return ::testing::AssertionFailure() << "export: " << image.status();
  absl::StatusOr<SnapshotInfo> imported = ImportImage(dst, *image, piece);
  if (!imported.ok()) return ::testing::AssertionFailure() << "import: " << imported.status();
  const std::optional<SnapshotInfo> original = FindSnapshot(src, id);
  const std::optional<SnapshotInfo> listed = FindSnapshot(dst, imported->id);
  if (!original.has_value() || !listed.has_value()) {
    return ::testing::AssertionFailure() << "snapshot not listed";
  }
  ::testing::AssertionResult same = SameInfo(*original, *imported);
  if (!same) return ::testing::AssertionFailure() << "returned info: " << same.message();
  same = SameInfo(*original, *listed);
  if (!same) return ::testing::AssertionFailure() << "listed info: " << same.message();
  *dst_id = imported->id;
  return ::testing::AssertionSuccess();
}

// `seq` reads the same in both caches (positions, states, payload) and lists the same.
::testing::AssertionResult SameSequence(const Cache& a, const Cache& b, int64_t seq) {
  absl::StatusOr<ReadResult> ra = a.Read(seq, 0, kNoEnd);
  absl::StatusOr<ReadResult> rb = b.Read(seq, 0, kNoEnd);
  if (ra.status().code() != rb.status().code()) {
    return ::testing::AssertionFailure() << "Read: " << ra.status() << " vs " << rb.status();
  }
  if (ra.ok()) {
    if (ra->positions != rb->positions) return ::testing::AssertionFailure() << "positions";
    if (ra->states != rb->states) return ::testing::AssertionFailure() << "states";
    ::testing::AssertionResult same = SameBytes(ra->payload, rb->payload);
    if (!same) return ::testing::AssertionFailure() << "payload: " << same.message();
  }
  const std::optional<SequenceInfo> ia = FindSequence(a, seq);
  const std::optional<SequenceInfo> ib = FindSequence(b, seq);
  if (ia.has_value() != ib.has_value()) return ::testing::AssertionFailure() << "liveness";
  if (ia.has_value()) {
    if (ia->offset != ib->offset || ia->pending != ib->pending ||
        ia->groups.size() != ib->groups.size()) {
      return ::testing::AssertionFailure() << "offset " << ia->offset << "/" << ib->offset;
    }
    for (size_t g = 0; g < ia->groups.size(); ++g) {
      const GroupSequenceInfo& x = ia->groups[g];
      const GroupSequenceInfo& y = ib->groups[g];
      if (x.stored != y.stored || x.shared != y.shared || x.first != y.first || x.last != y.last ||
          x.state != y.state) {
        return ::testing::AssertionFailure() << "ListSequences group " << g << " differs";
      }
    }
  }
  return ::testing::AssertionSuccess();
}

// Restores `a_id` in `a` and `b_id` in `b` into `seq` (in the same state in both) with
// `target`: the same status, then the same sequence.
::testing::AssertionResult SameRestore(Cache& a, uint64_t a_id, Cache& b, uint64_t b_id,
                                       int64_t seq, int32_t target) {
  const absl::Status sa = a.Restore(seq, a_id, target);
  const absl::Status sb = b.Restore(seq, b_id, target);
  if (sa.code() != sb.code()) {
    return ::testing::AssertionFailure()
           << "Restore(" << seq << ", target " << target << "): " << sa << " vs " << sb;
  }
  ::testing::AssertionResult same = SameSequence(a, b, seq);
  if (!same) {
    return ::testing::AssertionFailure()
           << "after Restore(" << seq << ", target " << target << "): " << same.message();
  }
  return ::testing::AssertionSuccess();
}

// Transfers `id` from src to a fresh cache of the same spec on another device, then restores
// both into `seq` (which must not be live in src) with each target and compares.
void ExpectRoundTrip(Cache& src, uint64_t id, const std::vector<int32_t>& targets, int64_t seq = 3,
                     size_t piece = kWhole) {
  TestCache dst(src.spec());
  ASSERT_NE(dst.cache, nullptr);
  uint64_t dst_id = 0;
  ASSERT_TRUE(Transfer(src, id, *dst.cache, &dst_id, piece));
  for (size_t i = 0; i < targets.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "target " << targets[i]);
    EXPECT_TRUE(SameRestore(src, id, *dst.cache, dst_id, seq, targets[i]));
    // The first target is the snapshot's end: that restore succeeds and writes data.
    if (i == 0) {
      EXPECT_TRUE(src.Read(seq, 0, kNoEnd).ok());
    }
  }
}

uint32_t Load32(const Image& image, size_t at) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | image[at + i];
  return v;
}
void Store32(Image* image, size_t at, uint32_t v) {
  for (int i = 0; i < 4; ++i) (*image)[at + i] = static_cast<uint8_t>(v >> (8 * i));
}
void Store64(Image* image, size_t at, uint64_t v) {
  for (int i = 0; i < 8; ++i) (*image)[at + i] = static_cast<uint8_t>(v >> (8 * i));
}

// ---- Round trips ----------------------------------------------------------------------------

TEST(TransferTest, AttentionWindowsAndDTypes) {
  for (DType dtype : kDTypes) {
    for (const WindowSpec& window : {Full(), Sliding(4, 6), Chunked(8)}) {
      SCOPED_TRACE(::testing::Message() << "dtype " << DTypeName(dtype) << " window kind "
                                        << static_cast<int>(window.kind));
      const CacheSpec spec =
          Spec(dtype, 4, 32, 4, {Group(window, 2, 2, 4, 6, Rope(RopeType::kNeox, 4))});
      TestCache src(spec);
      ASSERT_NE(src.cache, nullptr);
      for (int32_t p = 0; p < 20; p += 4) ASSERT_TRUE(AppendRange(*src.cache, 0, p, p + 4).ok());
      absl::StatusOr<SnapshotInfo> snap = src.cache->Snapshot(0, 0);
      ASSERT_TRUE(snap.ok()) << snap.status();
      ExpectRoundTrip(*src.cache, snap->id, {20, 13, 0, 20});
    }
  }
}

TEST(TransferTest, AttentionRestoresThePatternRows) {
  const CacheSpec spec = Spec(DType::kF16, 4, 32, 8, {Group(Full(), 2, 1, 4, 4)});
  TestCache src(spec);
  TestCache dst(spec);
  ASSERT_NE(src.cache, nullptr);
  ASSERT_NE(dst.cache, nullptr);
  // Sparse positions: an Attention-only cache takes any increasing positions.
  const std::vector<Token> tokens = {{0, 0}, {0, 3}, {0, 7}, {0, 8}, {0, 15}};
  ASSERT_TRUE(AppendTokens(*src.cache, tokens).ok());
  absl::StatusOr<SnapshotInfo> snap = src.cache->Snapshot(0, 0);
  ASSERT_TRUE(snap.ok()) << snap.status();
  uint64_t id = 0;
  ASSERT_TRUE(Transfer(*src.cache, snap->id, *dst.cache, &id));
  ASSERT_TRUE(dst.cache->Restore(5, id, 16).ok());
  const std::vector<int32_t> positions = {0, 3, 7, 8, 15};
  EXPECT_TRUE(ReadIs(*dst.cache, 5, 0, kNoEnd, {positions}, {Ids(0, positions)}));
  ASSERT_TRUE(dst.cache->Restore(6, id, 8).ok());
  EXPECT_TRUE(ReadIs(*dst.cache, 6, 0, kNoEnd, {{0, 3, 7}}, {Ids(0, {0, 3, 7})}));
}

TEST(TransferTest, RotatingBeforeAndAfterTheWrap) {
  for (DType dtype : kDTypes) {
    SCOPED_TRACE(DTypeName(dtype));
    const CacheSpec spec = Spec(dtype, 4, 32, 4, {RotatingGroup(8, 2, 2, 4, 2)});
    TestCache src(spec);
    ASSERT_NE(src.cache, nullptr);
    ASSERT_TRUE(AppendRange(*src.cache, 0, 0, 4).ok());
    ASSERT_TRUE(AppendRange(*src.cache, 0, 4, 5).ok());
    absl::StatusOr<SnapshotInfo> before = src.cache->Snapshot(0, 0);  // window [0, 5)
    ASSERT_TRUE(before.ok()) << before.status();
    EXPECT_EQ(before->groups[0].ring_index, 5);
    ExpectRoundTrip(*src.cache, before->id, {5, 3, 5});
    for (int32_t p = 5; p < 13; p += 4) {
      ASSERT_TRUE(AppendRange(*src.cache, 0, p, std::min(p + 4, 13)).ok());
    }
    absl::StatusOr<SnapshotInfo> after = src.cache->Snapshot(0, 2);  // window [5, 13)
    ASSERT_TRUE(after.ok()) << after.status();
    EXPECT_EQ(after->groups[0].ring_index, 5);
    EXPECT_EQ(after->groups[0].stored, 8);
    ExpectRoundTrip(*src.cache, after->id, {13, 10 /* refused in both */, 13}, /*seq=*/2);
  }
}

TEST(TransferTest, RecurrentConvOnlyAndConvPlusDelta) {
  for (DType dtype : kDTypes) {
    for (const GroupSpec& group :
         {RecurrentGroup(3, 3, 5, 0, 0, 0), RecurrentGroup(2, 2, 3, 2, 3, 4)}) {
      SCOPED_TRACE(::testing::Message()
                   << DTypeName(dtype) << " delta heads " << group.recurrent.num_v_heads);
      const CacheSpec spec = Spec(dtype, 3, 32, 4, {group});
      TestCache src(spec);
      ASSERT_NE(src.cache, nullptr);
      ASSERT_TRUE(AppendRange(*src.cache, 0, 0, 4).ok());
      ASSERT_TRUE(AppendRange(*src.cache, 0, 4, 6).ok());
      absl::StatusOr<SnapshotInfo> snap = src.cache->Snapshot(0, 1);
      ASSERT_TRUE(snap.ok()) << snap.status();
      ExpectRoundTrip(*src.cache, snap->id, {6, 5 /* refused in both */});
      // And the data is the state appended last.
      TestCache dst(spec);
      ASSERT_NE(dst.cache, nullptr);
      uint64_t id = 0;
      ASSERT_TRUE(Transfer(*src.cache, snap->id, *dst.cache, &id));
      ASSERT_TRUE(dst.cache->Restore(2, id, 6).ok());
      EXPECT_TRUE(ReadIs(*dst.cache, 2, 0, kNoEnd, {{}}, {{StateId(0, 6)}}));
    }
  }
}

// Rotating (rings of 4), Recurrent and Attention.
CacheSpec HybridSpec(DType dtype = DType::kF16) {
  return Spec(dtype, 4, 16, 8,
              {RotatingGroup(4, 2, 1, 4, 4), RecurrentGroup(2, 2, 3, 1, 2, 2),
               Group(Full(), 1, 1, 4, 4, Rope(RopeType::kNormal, 4))});
}

TEST(TransferTest, HybridCaches) {
  for (DType dtype : kDTypes) {
    SCOPED_TRACE(DTypeName(dtype));
    const CacheSpec spec = HybridSpec(dtype);
    TestCache src(spec);
    ASSERT_NE(src.cache, nullptr);
    ASSERT_TRUE(AppendRange(*src.cache, 0, 0, 7).ok());
    absl::StatusOr<SnapshotInfo> snap = src.cache->Snapshot(0, 0);
    ASSERT_TRUE(snap.ok()) << snap.status();
    ExpectRoundTrip(*src.cache, snap->id, {7, 6 /* refused */, 7});
    TestCache dst(spec);
    ASSERT_NE(dst.cache, nullptr);
    uint64_t id = 0;
    ASSERT_TRUE(Transfer(*src.cache, snap->id, *dst.cache, &id));
    ASSERT_TRUE(dst.cache->Restore(1, id, 7).ok());
    EXPECT_TRUE(ReadIs(*dst.cache, 1, 0, kNoEnd, {Range(3, 7), {}, Range(0, 7)},
                       {Ids(0, Range(3, 7)), {StateId(0, 7)}, Ids(0, Range(0, 7))}));
  }
  // An LFM2-like mix: sliding attention, a ring and a conv-only state.
  const CacheSpec lfm =
      Spec(DType::kBF16, 2, 32, 4, {Group(Sliding(2)), RotatingGroup(3), RecurrentGroup()});
  TestCache src(lfm);
  ASSERT_NE(src.cache, nullptr);
  for (int32_t p = 0; p < 10; p += 4) {
    ASSERT_TRUE(AppendRange(*src.cache, 0, p, std::min(p + 4, 10)).ok());
  }
  absl::StatusOr<SnapshotInfo> snap = src.cache->Snapshot(0, 0);
  ASSERT_TRUE(snap.ok()) << snap.status();
  ExpectRoundTrip(*src.cache, snap->id, {10}, /*seq=*/1);
}

TEST(TransferTest, SnapshotsThatStartPastZero) {
  // Attention only, and hybrid: the part from `from` restores over a sequence that reaches it.
  for (const CacheSpec& spec :
       {Spec(DType::kF16, 4, 32, 8, {Group(Full(), 2, 1, 4, 4, Rope(RopeType::kNormal, 4))}),
        HybridSpec()}) {
    TestCache src(spec);
    TestCache dst(spec);
    ASSERT_NE(src.cache, nullptr);
    ASSERT_NE(dst.cache, nullptr);
    ASSERT_TRUE(AppendRange(*src.cache, 0, 0, 8).ok());
    absl::StatusOr<SnapshotInfo> whole = src.cache->Snapshot(0, 0);
    ASSERT_TRUE(whole.ok()) << whole.status();
    ASSERT_TRUE(AppendRange(*src.cache, 0, 8, 12, /*salt=*/1).ok());
    absl::StatusOr<SnapshotInfo> tail = src.cache->Snapshot(0, 8);  // [8, 12)
    ASSERT_TRUE(tail.ok()) << tail.status();
    EXPECT_EQ(tail->from, 8);
    uint64_t whole_id = 0, tail_id = 0;
    ASSERT_TRUE(Transfer(*src.cache, whole->id, *dst.cache, &whole_id));
    ASSERT_TRUE(Transfer(*src.cache, tail->id, *dst.cache, &tail_id));
    // Seq 2 is new in both: the attention part of the tail cannot go there.
    EXPECT_TRUE(SameRestore(*src.cache, tail->id, *dst.cache, tail_id, 2, 12));
    EXPECT_TRUE(SameRestore(*src.cache, whole->id, *dst.cache, whole_id, 2, 8));
    EXPECT_TRUE(SameRestore(*src.cache, tail->id, *dst.cache, tail_id, 2, 12));
    absl::StatusOr<ReadResult> read = dst.cache->Read(2, 0, kNoEnd);
    ASSERT_TRUE(read.ok()) << read.status();
    EXPECT_EQ(read->positions.back(), Range(0, 12));
  }
}

TEST(TransferTest, AfterMergeAndSplit) {
  const CacheSpec spec =
      Spec(DType::kF16, 4, 32, 8, {Group(Full(), 2, 1, 4, 4, Rope(RopeType::kNormal, 4))});
  TestCache src(spec);
  TestCache dst(spec);
  ASSERT_NE(src.cache, nullptr);
  ASSERT_NE(dst.cache, nullptr);
  Cache& cache = *src.cache;
  // A merge of two snapshots of two sequences: two segments in two chunks.
  ASSERT_TRUE(AppendRange(cache, 0, 0, 4).ok());
  absl::StatusOr<SnapshotInfo> parent = cache.Snapshot(0, 0);
  ASSERT_TRUE(AppendRange(cache, 0, 4, 10).ok());
  ASSERT_TRUE(cache.CopyPrefix(0, 1, 10).ok());
  absl::StatusOr<SnapshotInfo> child = cache.Snapshot(1, 4);
  ASSERT_TRUE(parent.ok() && child.ok());
  absl::StatusOr<SnapshotInfo> merged = cache.MergeSnapshots(parent->id, child->id);
  ASSERT_TRUE(merged.ok()) << merged.status();
  ExpectRoundTrip(cache, merged->id, {10, 7, 10});
  // A split: the child's rows start inside the chunk.
  absl::StatusOr<SnapshotInfo> whole = cache.Snapshot(0, 0);
  absl::StatusOr<SnapshotInfo> part = cache.Snapshot(0, 2);
  ASSERT_TRUE(whole.ok() && part.ok());
  absl::StatusOr<SplitResult> split = cache.SplitSnapshot(part->id, 6);
  ASSERT_TRUE(split.ok() && split->parent.has_value() && split->child.has_value());
  uint64_t whole_id = 0, lo_id = 0, hi_id = 0;
  ASSERT_TRUE(Transfer(cache, whole->id, *dst.cache, &whole_id));
  ASSERT_TRUE(Transfer(cache, split->parent->id, *dst.cache, &lo_id));
  ASSERT_TRUE(Transfer(cache, split->child->id, *dst.cache, &hi_id));
  EXPECT_TRUE(SameRestore(cache, whole->id, *dst.cache, whole_id, 2, 10));
  EXPECT_TRUE(SameRestore(cache, split->parent->id, *dst.cache, lo_id, 2, 6));
  EXPECT_TRUE(SameRestore(cache, split->child->id, *dst.cache, hi_id, 2, 10));
  EXPECT_TRUE(ReadIs(*dst.cache, 2, 0, kNoEnd, {Range(0, 10)}, {Ids(0, Range(0, 10))}));
  // A merge in a hybrid cache keeps the child's ring and state.
  const CacheSpec hybrid = HybridSpec();
  TestCache hsrc(hybrid);
  ASSERT_NE(hsrc.cache, nullptr);
  ASSERT_TRUE(AppendRange(*hsrc.cache, 0, 0, 3).ok());
  absl::StatusOr<SnapshotInfo> hp = hsrc.cache->Snapshot(0, 0);
  ASSERT_TRUE(AppendRange(*hsrc.cache, 0, 3, 6).ok());
  absl::StatusOr<SnapshotInfo> hc = hsrc.cache->Snapshot(0, 3);
  ASSERT_TRUE(hp.ok() && hc.ok());
  absl::StatusOr<SnapshotInfo> hm = hsrc.cache->MergeSnapshots(hp->id, hc->id);
  ASSERT_TRUE(hm.ok()) << hm.status();
  ExpectRoundTrip(*hsrc.cache, hm->id, {6});
  // Split of a hybrid snapshot: the whole snapshot as child.
  absl::StatusOr<SplitResult> hs = hsrc.cache->SplitSnapshot(hm->id, 4);
  ASSERT_TRUE(hs.ok() && hs->child.has_value());
  ExpectRoundTrip(*hsrc.cache, hs->child->id, {6});
}

// A snapshot of a few MiB: 4 layers x 8 heads x 64 dims in F32, 256 tokens.
CacheSpec LargeSpec() {
  return Spec(DType::kF32, 2, 512, 64, {Group(Full(), 4, 8, 64, 64), RecurrentGroup(1, 3, 64)});
}

// Appends n tokens to sequence 0, snapshots it, and gives the snapshot, its whole image (through
// ExportImage) and a reader of its own.
void SnapshotAndOpen(Cache& cache, int32_t n, std::optional<SnapshotInfo>* snap,
                     std::optional<Image>* whole, std::unique_ptr<SnapshotExportReader>* reader) {
  const int32_t batch = cache.spec().max_batch;
  for (int32_t p = 0; p < n; p += batch) {
    ASSERT_TRUE(AppendRange(cache, 0, p, std::min(p + batch, n)).ok());
  }
  absl::StatusOr<SnapshotInfo> taken = cache.Snapshot(0, 0);
  ASSERT_TRUE(taken.ok()) << taken.status();
  absl::StatusOr<Image> image = ExportImage(cache, taken->id);
  ASSERT_TRUE(image.ok()) << image.status();
  absl::StatusOr<std::unique_ptr<SnapshotExportReader>> opened =
      cache.OpenSnapshotExport(taken->id);
  ASSERT_TRUE(opened.ok()) << opened.status();
  *snap = *taken;
  *whole = *std::move(image);
  *reader = *std::move(opened);
}

TEST(TransferTest, ReadsInOddPiecesAtAnyOffset) {
  for (const CacheSpec& spec : {HybridSpec(), LargeSpec()}) {
    TestCache src(spec);
    ASSERT_NE(src.cache, nullptr);
    Cache& cache = *src.cache;
    const int32_t n = spec.capacity == 512 ? 256 : 7;
    std::optional<SnapshotInfo> snap;
    std::optional<Image> whole;
    std::unique_ptr<SnapshotExportReader> reader;
    ASSERT_NO_FATAL_FAILURE(SnapshotAndOpen(cache, n, &snap, &whole, &reader));
    SnapshotExportReader& r = *reader;
    EXPECT_EQ(r.size(), whole->size());
    EXPECT_EQ(r.info().id, snap->id);
    EXPECT_TRUE(SameInfo(r.info(), *snap));
    // Sequential pieces of odd sizes, as a transport reads.
    for (size_t piece :
         {size_t{1}, size_t{3}, size_t{7}, size_t{1000}, size_t{4099}, size_t{(4 << 20) + 1}}) {
      // A piece smaller than a row gathers the row once per piece: too slow on a large image.
      if (piece < 1000 && whole->size() > (1 << 20)) continue;
      Image got(whole->size());
      for (size_t at = 0; at < got.size(); at += piece) {
        const size_t len = std::min(piece, got.size() - at);
        ASSERT_TRUE(r.ReadAt(at, absl::MakeSpan(got).subspan(at, len)).ok());
      }
      EXPECT_TRUE(got == *whole) << "pieces of " << piece;
    }
    // Random ranges.
    std::mt19937_64 rng(42);
    for (int i = 0; i < 300; ++i) {
      const size_t at = rng() % (whole->size() + 1);
      const size_t max_len = std::min<size_t>(whole->size() - at, i % 3 == 0 ? 70000 : 300);
      const size_t len = max_len == 0 ? 0 : rng() % (max_len + 1);
      Image got(len);
      ASSERT_TRUE(r.ReadAt(at, absl::MakeSpan(got)).ok()) << at << "+" << len;
      EXPECT_TRUE(std::equal(got.begin(), got.end(), whole->begin() + at)) << at << "+" << len;
    }
    // Past the end.
    Image one(1);
    EXPECT_TRUE(IsError(r.ReadAt(whole->size(), absl::MakeSpan(one)), absl::StatusCode::kOutOfRange,
                        {std::to_string(whole->size())}));
    Image two(2);
    EXPECT_TRUE(
        IsError(r.ReadAt(whole->size() - 1, absl::MakeSpan(two)), absl::StatusCode::kOutOfRange));
    EXPECT_TRUE(
        IsError(r.ReadAt(whole->size() + 1, absl::Span<uint8_t>()), absl::StatusCode::kOutOfRange));
    EXPECT_TRUE(r.ReadAt(whole->size(), absl::Span<uint8_t>()).ok());
  }
}

// View hands out the image where it lies: on the host device every byte, in runs that end at
// the header's end or a plane's; the bytes stay put after the snapshot is dropped (the reader
// pins them). On a GPU only the header is in host memory: the rest is empty (ReadAt's).
TEST(TransferTest, ViewsCoverTheImageWithoutCopies) {
  for (const CacheSpec& spec : {HybridSpec(), LargeSpec()}) {
    TestCache src(spec);
    ASSERT_NE(src.cache, nullptr);
    Cache& cache = *src.cache;
    const int32_t n = spec.capacity == 512 ? 256 : 7;
    std::optional<SnapshotInfo> snap;
    std::optional<Image> whole;
    std::unique_ptr<SnapshotExportReader> reader;
    ASSERT_NO_FATAL_FAILURE(SnapshotAndOpen(cache, n, &snap, &whole, &reader));
    const SnapshotExportReader& r = *reader;
    uint32_t header_bytes = 0;
    std::memcpy(&header_bytes, whole->data() + 12, 4);
    EXPECT_TRUE(r.View(whole->size(), 10).empty());
    EXPECT_TRUE(r.View(0, 0).empty());
    const absl::Span<const uint8_t> header = r.View(0, whole->size());
    ASSERT_EQ(header.size(), header_bytes);
    EXPECT_TRUE(std::equal(header.begin(), header.end(), whole->begin()));
    if (testutil::TestOnCuda()) {
      EXPECT_TRUE(r.View(header_bytes, whole->size()).empty());
      continue;
    }
    ASSERT_TRUE(cache.DropSnapshot(snap->id).ok());
    for (size_t max : {whole->size(), size_t{4099}, size_t{1000}}) {
      Image got;
      size_t runs = 0;
      for (size_t at = 0; at < whole->size();) {
        const absl::Span<const uint8_t> v = r.View(at, max);
        ASSERT_FALSE(v.empty()) << "at " << at;
        ASSERT_LE(v.size(), max);
        // The same bytes, not a copy: asking again gives the same address.
        EXPECT_EQ(r.View(at, max).data(), v.data());
        got.insert(got.end(), v.begin(), v.end());
        at += v.size();
        ++runs;
      }
      EXPECT_TRUE(got == *whole) << "views of at most " << max;
      if (max == whole->size() && n == 256) {
        // The header, then one run per plane of each segment: far fewer than one per row.
        EXPECT_GT(runs, 1u);
        EXPECT_LT(runs, static_cast<size_t>(n));
      }
    }
    // A view from the middle of a row runs to the end of its plane.
    const absl::Span<const uint8_t> mid = r.View(header_bytes + 3, whole->size());
    ASSERT_FALSE(mid.empty());
    EXPECT_TRUE(std::equal(mid.begin(), mid.end(), whole->begin() + header_bytes + 3));
  }
}

TEST(TransferTest, WritesInOddPieces) {
  const CacheSpec spec = LargeSpec();
  TestCache src(spec);
  ASSERT_NE(src.cache, nullptr);
  for (int32_t p = 0; p < 256; p += 64) ASSERT_TRUE(AppendRange(*src.cache, 0, p, p + 64).ok());
  absl::StatusOr<SnapshotInfo> snap = src.cache->Snapshot(0, 0);
  ASSERT_TRUE(snap.ok()) << snap.status();
  absl::StatusOr<Image> image = ExportImage(*src.cache, snap->id);
  ASSERT_TRUE(image.ok()) << image.status();
  ASSERT_GT(image->size(), size_t{3} << 20);
  for (size_t piece : {size_t{1}, size_t{7}, size_t{1} << 20, size_t{(1 << 20) + 3}}) {
    SCOPED_TRACE(::testing::Message() << "pieces of " << piece);
    ExpectRoundTrip(*src.cache, snap->id, {256, 100}, /*seq=*/1, piece);
  }
  // Pieces of random sizes, some large enough to bypass the staging buffer.
  TestCache dst(spec);
  ASSERT_NE(dst.cache, nullptr);
  absl::StatusOr<std::unique_ptr<SnapshotImportWriter>> writer =
      dst.cache->BeginSnapshotImport(image->size());
  ASSERT_TRUE(writer.ok()) << writer.status();
  std::mt19937_64 rng(7);
  for (size_t at = 0; at < image->size();) {
    const size_t r = rng() % 4;
    const size_t want = r == 0 ? rng() % 8 : r == 1 ? rng() % 5000 : rng() % (1 << 19);
    const size_t n = std::min(want, image->size() - at);
    ASSERT_TRUE((*writer)->Write(absl::MakeConstSpan(*image).subspan(at, n)).ok());
    at += n;
  }
  absl::StatusOr<SnapshotInfo> imported = (*writer)->Commit();
  ASSERT_TRUE(imported.ok()) << imported.status();
  ASSERT_TRUE(src.cache->Restore(1, snap->id, 256).ok());
  ASSERT_TRUE(dst.cache->Restore(1, imported->id, 256).ok());
  EXPECT_TRUE(SameSequence(*src.cache, *dst.cache, 1));
}

TEST(TransferTest, TheComparisonSeesEveryDataByte) {
  // The image carries no checksum of its own (the transport checks one): a flipped data byte
  // imports, and the restored bytes differ exactly there.
  const CacheSpec spec = HybridSpec();
  TestCache src(spec);
  TestCache dst(spec);
  ASSERT_NE(src.cache, nullptr);
  ASSERT_NE(dst.cache, nullptr);
  ASSERT_TRUE(AppendRange(*src.cache, 0, 0, 7).ok());
  absl::StatusOr<SnapshotInfo> snap = src.cache->Snapshot(0, 0);
  ASSERT_TRUE(snap.ok());
  absl::StatusOr<Image> image = ExportImage(*src.cache, snap->id);
  ASSERT_TRUE(image.ok());
  image->back() ^= 0x40;  // the last byte: V of the attention group's last row
  absl::StatusOr<SnapshotInfo> imported = ImportImage(*dst.cache, *image, 5);
  ASSERT_TRUE(imported.ok()) << imported.status();
  ASSERT_TRUE(src.cache->Restore(1, snap->id, 7).ok());
  ASSERT_TRUE(dst.cache->Restore(1, imported->id, 7).ok());
  absl::StatusOr<ReadResult> a = src.cache->Read(1, 0, kNoEnd);
  absl::StatusOr<ReadResult> b = dst.cache->Read(1, 0, kNoEnd);
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_EQ(a->payload.size(), b->payload.size());
  EXPECT_EQ(a->payload.back() ^ 0x40, b->payload.back());
  EXPECT_EQ(a->payload.substr(0, a->payload.size() - 1),
            b->payload.substr(0, b->payload.size() - 1));
}

// ---- Refusals ------------------------------------------------------------------------------

// One Attention group of one layer (2 planes): the header is
//   0 magic, 8 version, 12 header_bytes, 16 total_bytes, 24 spec_fingerprint, 32 seq, 40 from,
//   44 to, 48 num_groups, 52 kind, 56 ring_index, 60 has_state, 64 num_planes, 68 row_bytes[2],
//   84 num_segments, 88 rows, 92 positions[rows].
constexpr size_t kNumPlanesAt = 64;
constexpr size_t kRowBytesAt = 68;
constexpr size_t kNumSegmentsAt = 84;
constexpr size_t kRowsAt = 88;
constexpr size_t kPositionsAt = 92;

CacheSpec SmallSpec() { return Spec(DType::kF16, 2, 16, 8, {Group(Full(), 1, 1, 4, 4)}); }

// Whether importing `image` into `cache` (announcing `total` bytes) fails with `code` naming
// `names`, leaving no snapshot and nothing in the snapshot pool, and the error is final.
::testing::AssertionResult ImportFails(TestCache& tc, const Image& image, absl::StatusCode code,
                                       const std::vector<std::string>& names,
                                       std::optional<size_t> total = std::nullopt,
                                       size_t piece = kWhole) {
  Cache& cache = *tc.cache;
  const size_t pool = tc.device->used_bytes(MemoryPool::kSnapshot);
  const size_t snapshots = cache.ListSnapshots().size();
  const size_t snapshot_bytes = cache.Usage().snapshot_bytes;
  absl::StatusOr<std::unique_ptr<SnapshotImportWriter>> writer =
      cache.BeginSnapshotImport(total.value_or(image.size()));
  if (!writer.ok()) return ::testing::AssertionFailure() << "Begin: " << writer.status();
  absl::Status status;
  for (size_t at = 0; at < image.size() && status.ok();) {
    const size_t n = std::min(piece, image.size() - at);
    status = (*writer)->Write(absl::MakeConstSpan(image).subspan(at, n));
    at += n;
  }
  if (status.ok()) status = (*writer)->Commit().status();
  ::testing::AssertionResult matches = IsError(status, code, names);
  if (!matches) return matches;
  // Final: every later call repeats it.
  const uint8_t byte = 0;
  if ((*writer)->Write({&byte, 1}) != status || (*writer)->Commit().status() != status) {
    return ::testing::AssertionFailure() << "the error " << status << " is not final";
  }
  if (tc.device->used_bytes(MemoryPool::kSnapshot) != pool) {
    return ::testing::AssertionFailure() << "the failed import holds pool bytes";
  }
  writer->reset();
  if (tc.device->used_bytes(MemoryPool::kSnapshot) != pool ||
      cache.ListSnapshots().size() != snapshots || cache.Usage().snapshot_bytes != snapshot_bytes) {
    return ::testing::AssertionFailure() << "the failed import left something behind";
  }
  return ::testing::AssertionSuccess();
}

class RefusalTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_NE(src_.cache, nullptr);
    ASSERT_NE(dst_.cache, nullptr);
    ASSERT_TRUE(AppendRange(*src_.cache, 0, 0, 6).ok());
    absl::StatusOr<SnapshotInfo> snap = src_.cache->Snapshot(0, 1);  // [1, 6)
    ASSERT_TRUE(snap.ok()) << snap.status();
    absl::StatusOr<Image> image = ExportImage(*src_.cache, snap->id);
    ASSERT_TRUE(image.ok()) << image.status();
    image_ = *image;
    ASSERT_EQ(Load32(image_, kNumPlanesAt), 2u);
    ASSERT_EQ(Load32(image_, kNumSegmentsAt), 1u);
    ASSERT_EQ(Load32(image_, kRowsAt), 5u);
    ASSERT_EQ(Load32(image_, 12), kPositionsAt + 5 * 4);  // header_bytes
  }

  Image With32(size_t at, uint32_t v) const {
    Image image = image_;
    Store32(&image, at, v);
    return image;
  }

  TestCache src_{SmallSpec()};
  TestCache dst_{SmallSpec()};
  Image image_;
};

TEST_F(RefusalTest, TheUnchangedImageImports) {
  absl::StatusOr<SnapshotInfo> info = ImportImage(*dst_.cache, image_);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->from, 1);
  EXPECT_EQ(info->to, 6);
}

TEST_F(RefusalTest, UnknownSnapshotAndTooSmallImports) {
  EXPECT_TRUE(
      IsError(src_.cache->OpenSnapshotExport(42).status(), absl::StatusCode::kNotFound, {"42"}));
  const size_t min = MinSnapshotHeaderBytes(SmallSpec());
  EXPECT_EQ(min, kRowsAt);
  EXPECT_TRUE(IsError(dst_.cache->BeginSnapshotImport(min - 1).status(),
                      absl::StatusCode::kInvalidArgument,
                      {"total_bytes", std::to_string(min - 1), std::to_string(min)}));
  EXPECT_TRUE(IsError(dst_.cache->BeginSnapshotImport(0).status(),
                      absl::StatusCode::kInvalidArgument, {"total_bytes"}));
}

TEST_F(RefusalTest, TruncatedAndExtraBytes) {
  // Fewer bytes than announced: Commit refuses.
  Image truncated(image_.begin(), image_.end() - 1);
  EXPECT_TRUE(ImportFails(dst_, truncated, absl::StatusCode::kFailedPrecondition,
                          {"total_bytes", std::to_string(image_.size())}, image_.size()));
  // A truncated image announced at its own size: the header's total_bytes differs.
  EXPECT_TRUE(ImportFails(dst_, truncated, absl::StatusCode::kInvalidArgument,
                          {"total_bytes", std::to_string(image_.size())}));
  // Truncated inside the header: the header does not fit.
  Image short_header(image_.begin(), image_.begin() + kPositionsAt + 8);
  EXPECT_TRUE(ImportFails(dst_, short_header, absl::StatusCode::kInvalidArgument, {"total_bytes"}));
  // More bytes than announced.
  Image extra = image_;
  extra.push_back(0);
  EXPECT_TRUE(ImportFails(dst_, extra, absl::StatusCode::kInvalidArgument,
                          {"total_bytes", std::to_string(image_.size())}, image_.size()));
  EXPECT_TRUE(ImportFails(dst_, extra, absl::StatusCode::kInvalidArgument,
                          {"total_bytes", std::to_string(image_.size())}, image_.size(), 7));
  // Announced and sent with extra bytes: the header's total_bytes differs.
  EXPECT_TRUE(ImportFails(dst_, extra, absl::StatusCode::kInvalidArgument, {"total_bytes"}));
  // Commit before the end of the header.
  absl::StatusOr<std::unique_ptr<SnapshotImportWriter>> writer =
      dst_.cache->BeginSnapshotImport(image_.size());
  ASSERT_TRUE(writer.ok());
  ASSERT_TRUE((*writer)->Write(absl::MakeConstSpan(image_).subspan(0, 10)).ok());
  EXPECT_TRUE(IsError((*writer)->Commit().status(), absl::StatusCode::kFailedPrecondition, {"10"}));
}

TEST_F(RefusalTest, CorruptPreamble) {
  Image magic = image_;
  magic[0] ^= 0xFF;
  EXPECT_TRUE(ImportFails(dst_, magic, absl::StatusCode::kInvalidArgument, {"magic"}));
  // Found as soon as the preamble is complete, one byte at a time too.
  EXPECT_TRUE(
      ImportFails(dst_, magic, absl::StatusCode::kInvalidArgument, {"magic"}, std::nullopt, 1));
  EXPECT_TRUE(
      ImportFails(dst_, With32(8, 3), absl::StatusCode::kInvalidArgument, {"version", "3"}));
  EXPECT_TRUE(ImportFails(dst_, With32(12, static_cast<uint32_t>(image_.size() + 1)),
                          absl::StatusCode::kInvalidArgument, {"header_bytes"}));
  EXPECT_TRUE(ImportFails(dst_, With32(12, 40), absl::StatusCode::kInvalidArgument,
                          {"header_bytes", "40"}));
  // One position short or long: the fields do not end where the header says.
  EXPECT_TRUE(ImportFails(dst_, With32(12, kPositionsAt + 4 * 4),
                          absl::StatusCode::kInvalidArgument, {"header_bytes"}));
  EXPECT_TRUE(ImportFails(dst_, With32(12, kPositionsAt + 6 * 4),
                          absl::StatusCode::kInvalidArgument, {"header_bytes"}));
  Image total = image_;
  Store64(&total, 16, image_.size() + 100);
  EXPECT_TRUE(ImportFails(dst_, total, absl::StatusCode::kInvalidArgument, {"total_bytes"}));
  Image fingerprint = image_;
  fingerprint[24] ^= 1;
  EXPECT_TRUE(
      ImportFails(dst_, fingerprint, absl::StatusCode::kFailedPrecondition, {"spec_fingerprint"}));
}

TEST_F(RefusalTest, CorruptSnapshotFields) {
  Image seq = image_;
  Store64(&seq, 32, static_cast<uint64_t>(-1));
  EXPECT_TRUE(ImportFails(dst_, seq, absl::StatusCode::kInvalidArgument, {"seq"}));
  EXPECT_TRUE(ImportFails(dst_, With32(40, static_cast<uint32_t>(-1)),
                          absl::StatusCode::kInvalidArgument, {"from"}));
  EXPECT_TRUE(ImportFails(dst_, With32(44, 1), absl::StatusCode::kInvalidArgument, {"to"}));
  EXPECT_TRUE(ImportFails(dst_, With32(48, 2), absl::StatusCode::kInvalidArgument, {"num_groups"}));
  EXPECT_TRUE(
      ImportFails(dst_, With32(52, 1), absl::StatusCode::kInvalidArgument, {"groups[0].kind"}));
  EXPECT_TRUE(ImportFails(dst_, With32(56, 3), absl::StatusCode::kInvalidArgument,
                          {"groups[0].ring_index"}));
  EXPECT_TRUE(ImportFails(dst_, With32(60, 1), absl::StatusCode::kInvalidArgument,
                          {"groups[0].has_state"}));
  EXPECT_TRUE(ImportFails(dst_, With32(kNumPlanesAt, 0xFFFFFFFFu),
                          absl::StatusCode::kInvalidArgument, {"groups[0].num_planes"}));
  EXPECT_TRUE(ImportFails(dst_, With32(kRowBytesAt + 8, 10), absl::StatusCode::kInvalidArgument,
                          {"groups[0].row_bytes[1]"}));
  EXPECT_TRUE(ImportFails(dst_, With32(kNumSegmentsAt, 0xFFFFFFFFu),
                          absl::StatusCode::kInvalidArgument, {"groups[0].num_segments"}));
  EXPECT_TRUE(ImportFails(dst_, With32(kRowsAt, 0), absl::StatusCode::kInvalidArgument,
                          {"groups[0].segments[0].rows"}));
  EXPECT_TRUE(ImportFails(dst_, With32(kRowsAt, 0xFFFFFFFFu), absl::StatusCode::kInvalidArgument,
                          {"groups[0].segments[0].rows"}));
  // Positions: not ascending, past the end, before the start.
  EXPECT_TRUE(ImportFails(dst_, With32(kPositionsAt + 2 * 4, 2), absl::StatusCode::kInvalidArgument,
                          {"groups[0].segments[0].positions[2]", "2"}));
  EXPECT_TRUE(ImportFails(dst_, With32(kPositionsAt + 4 * 4, 6), absl::StatusCode::kInvalidArgument,
                          {"groups[0].segments[0].positions[4]", "6"}));
  EXPECT_TRUE(ImportFails(dst_, With32(kPositionsAt, 0), absl::StatusCode::kInvalidArgument,
                          {"groups[0].segments[0].positions[0]", "0"}));
  EXPECT_TRUE(ImportFails(dst_, With32(kPositionsAt, static_cast<uint32_t>(-5)),
                          absl::StatusCode::kInvalidArgument,
                          {"groups[0].segments[0].positions[0]"}));
  // Four rows announced in an image of five: the header and the data disagree.
  EXPECT_TRUE(ImportFails(dst_, With32(kRowsAt, 4), absl::StatusCode::kInvalidArgument,
                          {"header_bytes", "108"}));
}

TEST(TransferRefusalTest, RotatingAndRecurrentFields) {
  // Rotating (rings of 4) then Recurrent, one layer each.
  const CacheSpec spec = Spec(DType::kF16, 2, 16, 8, {RotatingGroup(4), RecurrentGroup()});
  TestCache src(spec);
  TestCache dst(spec);
  ASSERT_NE(src.cache, nullptr);
  ASSERT_NE(dst.cache, nullptr);
  ASSERT_TRUE(AppendRange(*src.cache, 0, 0, 6).ok());
  absl::StatusOr<SnapshotInfo> snap = src.cache->Snapshot(0, 0);  // window [2, 6)
  ASSERT_TRUE(snap.ok()) << snap.status();
  absl::StatusOr<Image> image = ExportImage(*src.cache, snap->id);
  ASSERT_TRUE(image.ok()) << image.status();
  // Group 0 as in RefusalTest; group 1 starts after its 4 positions.
  const size_t g1 = kPositionsAt + 4 * 4;
  ASSERT_EQ(Load32(*image, 56), 2u);  // ring_index = 6 mod 4
  ASSERT_EQ(Load32(*image, g1), 2u);  // kind Recurrent
  auto with = [&](size_t at, uint32_t v) {
    Image copy = *image;
    Store32(&copy, at, v);
    return copy;
  };
  EXPECT_TRUE(ImportFails(dst, with(56, 1), absl::StatusCode::kInvalidArgument,
                          {"groups[0].ring_index", "1", "2"}));
  // A position outside the window [2, 6).
  EXPECT_TRUE(ImportFails(dst, with(kPositionsAt, 1), absl::StatusCode::kInvalidArgument,
                          {"groups[0].segments[0].positions[0]", "1"}));
  // Recurrent: ring_index, has_state, segments and rows.
  EXPECT_TRUE(ImportFails(dst, with(g1 + 4, 0), absl::StatusCode::kInvalidArgument,
                          {"groups[1].ring_index"}));
  EXPECT_TRUE(ImportFails(dst, with(g1 + 8, 0), absl::StatusCode::kInvalidArgument,
                          {"groups[1].num_segments"}));
  EXPECT_TRUE(ImportFails(dst, with(g1 + 8, 2), absl::StatusCode::kInvalidArgument,
                          {"groups[1].has_state"}));
  const size_t g1_segments = g1 + 16 + 8;  // one plane
  ASSERT_EQ(Load32(*image, g1_segments), 1u);
  EXPECT_TRUE(ImportFails(dst, with(g1_segments + 4, 2), absl::StatusCode::kInvalidArgument,
                          {"groups[1].segments[0].rows"}));
  // And the unchanged image imports.
  uint64_t id = 0;
  ASSERT_TRUE(Transfer(*src.cache, snap->id, *dst.cache, &id));
}

// Found by tests/fuzz/snapshot_import_fuzzer (regressions/snapshot_import_fuzzer/
// rotating-window-without-rows): an image whose Rotating group held no rows at all was accepted,
// and restoring it gave a sequence the whole window [to - max_size, to) with whatever bytes the
// ring it was given held before (an earlier sequence's). A Rotating group carries its whole
// window or the image is refused.
TEST(TransferRefusalTest, RotatingGroupWithoutItsWindow) {
  const CacheSpec spec = Spec(DType::kF16, 2, 16, 8, {RotatingGroup(4)});
  TestCache src(spec);
  TestCache dst(spec);
  ASSERT_NE(src.cache, nullptr);
  ASSERT_NE(dst.cache, nullptr);
  ASSERT_TRUE(AppendRange(*src.cache, 0, 0, 6).ok());
  absl::StatusOr<SnapshotInfo> snap = src.cache->Snapshot(0, 0);  // window [2, 6)
  ASSERT_TRUE(snap.ok()) << snap.status();
  absl::StatusOr<Image> image = ExportImage(*src.cache, snap->id);
  ASSERT_TRUE(image.ok()) << image.status();
  ASSERT_EQ(Load32(*image, kNumSegmentsAt), 1u);
  ASSERT_EQ(Load32(*image, kRowsAt), 4u);
  // The same header with no segment, and no data.
  Image empty(image->begin(), image->begin() + kRowsAt);
  Store32(&empty, kNumSegmentsAt, 0);
  Store32(&empty, 12, static_cast<uint32_t>(empty.size()));  // header_bytes
  Store32(&empty, 16, static_cast<uint32_t>(empty.size()));  // total_bytes (low half)
  EXPECT_TRUE(ImportFails(dst, empty, absl::StatusCode::kInvalidArgument,
                          {"groups[0]", "holds 0 positions", "[2, 6)"}));
  // Sequence 1 of the destination once used a ring, so a restore that wrote no rows would show
  // its bytes; with the window the image carries, the restored sequence reads the source's rows.
  ASSERT_TRUE(AppendRange(*dst.cache, 1, 0, 3).ok());
  ASSERT_TRUE(dst.cache->Remove(1, 0, std::nullopt).ok());
  uint64_t id = 0;
  ASSERT_TRUE(Transfer(*src.cache, snap->id, *dst.cache, &id));
  ASSERT_TRUE(dst.cache->Restore(1, id, 6).ok());
  absl::StatusOr<ReadResult> want = src.cache->Read(0, 0, std::nullopt);
  absl::StatusOr<ReadResult> got = dst.cache->Read(1, 0, std::nullopt);
  ASSERT_TRUE(want.ok() && got.ok());
  EXPECT_EQ(got->positions, want->positions);
  EXPECT_EQ(got->payload, want->payload);
}

TEST(TransferRefusalTest, SpecMismatchIsFailedPrecondition) {
  const CacheSpec spec = SmallSpec();
  TestCache src(spec);
  ASSERT_NE(src.cache, nullptr);
  ASSERT_TRUE(AppendRange(*src.cache, 0, 0, 4).ok());
  absl::StatusOr<SnapshotInfo> snap = src.cache->Snapshot(0, 0);
  ASSERT_TRUE(snap.ok()) << snap.status();
  absl::StatusOr<Image> image = ExportImage(*src.cache, snap->id);
  ASSERT_TRUE(image.ok());
  std::vector<CacheSpec> others;
  others.push_back(spec);
  others.back().capacity = 17;
  others.push_back(spec);
  others.back().dtype = DType::kBF16;
  others.push_back(spec);
  others.back().max_sequences = 3;
  others.push_back(spec);
  others.back().groups[0].attention.rope = Rope(RopeType::kNeox, 4);
  others.push_back(spec);
  others.back().groups[0].attention.window = Sliding(4);
  for (const CacheSpec& other : others) {
    TestCache dst(other);
    ASSERT_NE(dst.cache, nullptr);
    EXPECT_NE(SpecFingerprint(other), SpecFingerprint(spec));
    EXPECT_TRUE(ImportFails(dst, *image, absl::StatusCode::kFailedPrecondition,
                            {"spec_fingerprint", other.name}));
  }
  // The name is not part of the fingerprint; rope fields without rotation are ignored.
  CacheSpec renamed = spec;
  renamed.name = "other-name";
  renamed.groups[0].attention.rope.dims = 2;
  EXPECT_EQ(SpecFingerprint(renamed), SpecFingerprint(spec));
  TestCache dst(renamed);
  ASSERT_NE(dst.cache, nullptr);
  uint64_t id = 0;
  EXPECT_TRUE(Transfer(*src.cache, snap->id, *dst.cache, &id));
}

TEST(TransferRefusalTest, FullSnapshotPoolChargesNothing) {
  const CacheSpec spec = HybridSpec();
  TestCache src(spec);
  ASSERT_NE(src.cache, nullptr);
  ASSERT_TRUE(AppendRange(*src.cache, 0, 0, 7).ok());
  absl::StatusOr<SnapshotInfo> snap = src.cache->Snapshot(0, 0);
  ASSERT_TRUE(snap.ok()) << snap.status();
  absl::StatusOr<Image> image = ExportImage(*src.cache, snap->id);
  ASSERT_TRUE(image.ok());
  // One byte short: every group but the last gets its chunk, then the last fails.
  TestCache dst(spec, size_t{1} << 30, snap->bytes - 1);
  ASSERT_NE(dst.cache, nullptr);
  EXPECT_TRUE(ImportFails(dst, *image, absl::StatusCode::kResourceExhausted, {}));
  EXPECT_EQ(dst.cache->Usage().snapshot_bytes, 0u);
  EXPECT_EQ(dst.device->used_bytes(MemoryPool::kSnapshot), 0u);
  // With a snapshot already held, the pool is back to exactly that after the refusal.
  TestCache held(spec, size_t{1} << 30, snap->bytes + 64);
  ASSERT_NE(held.cache, nullptr);
  ASSERT_TRUE(AppendRange(*held.cache, 0, 0, 2).ok());
  ASSERT_TRUE(held.cache->Snapshot(0, 0).ok());
  const size_t before = held.cache->Usage().snapshot_bytes;
  EXPECT_TRUE(ImportFails(held, *image, absl::StatusCode::kResourceExhausted, {}));
  EXPECT_EQ(held.cache->Usage().snapshot_bytes, before);
  // No budget at all: refused from the header's size alone.
  TestCache none(spec, size_t{1} << 30, 0);
  ASSERT_NE(none.cache, nullptr);
  EXPECT_TRUE(ImportFails(none, *image, absl::StatusCode::kResourceExhausted, {"header_bytes"}));
  // And with exactly enough it fits.
  TestCache exact(spec, size_t{1} << 30, snap->bytes);
  ASSERT_NE(exact.cache, nullptr);
  uint64_t id = 0;
  EXPECT_TRUE(Transfer(*src.cache, snap->id, *exact.cache, &id));
}

// ---- Lifetimes -----------------------------------------------------------------------------

TEST(TransferLifetimeTest, WriterDestroyedWithoutCommitFreesEverything) {
  const CacheSpec spec = HybridSpec();
  TestCache src(spec);
  TestCache dst(spec);
  ASSERT_NE(src.cache, nullptr);
  ASSERT_NE(dst.cache, nullptr);
  ASSERT_TRUE(AppendRange(*src.cache, 0, 0, 7).ok());
  absl::StatusOr<SnapshotInfo> snap = src.cache->Snapshot(0, 0);
  ASSERT_TRUE(snap.ok());
  absl::StatusOr<Image> image = ExportImage(*src.cache, snap->id);
  ASSERT_TRUE(image.ok());
  for (size_t written : {size_t{0}, size_t{20}, image->size() / 2, image->size()}) {
    SCOPED_TRACE(::testing::Message() << written << " bytes written");
    absl::StatusOr<std::unique_ptr<SnapshotImportWriter>> writer =
        dst.cache->BeginSnapshotImport(image->size());
    ASSERT_TRUE(writer.ok());
    ASSERT_TRUE((*writer)->Write(absl::MakeConstSpan(*image).subspan(0, written)).ok());
    EXPECT_EQ((*writer)->written(), written);
    if (written == image->size()) {
      EXPECT_EQ(dst.device->used_bytes(MemoryPool::kSnapshot), snap->bytes);
    }
    EXPECT_TRUE(dst.cache->ListSnapshots().empty());
    EXPECT_EQ(dst.cache->Usage().snapshot_bytes, 0u);
    writer->reset();
    EXPECT_EQ(dst.device->used_bytes(MemoryPool::kSnapshot), 0u);
    EXPECT_TRUE(dst.cache->ListSnapshots().empty());
  }
  // A committed writer: further calls are refused, the snapshot stays.
  absl::StatusOr<std::unique_ptr<SnapshotImportWriter>> writer =
      dst.cache->BeginSnapshotImport(image->size());
  ASSERT_TRUE(writer.ok());
  ASSERT_TRUE((*writer)->Write(*image).ok());
  absl::StatusOr<SnapshotInfo> info = (*writer)->Commit();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->id, 1u);
  EXPECT_TRUE(IsError((*writer)->Commit().status(), absl::StatusCode::kFailedPrecondition));
  EXPECT_TRUE(IsError((*writer)->Write(*image), absl::StatusCode::kFailedPrecondition));
  writer->reset();
  EXPECT_EQ(dst.cache->ListSnapshots().size(), 1u);
  EXPECT_EQ(dst.cache->Usage().snapshot_bytes, snap->bytes);
  // Ids of imported snapshots continue the cache's own.
  ASSERT_TRUE(AppendRange(*dst.cache, 0, 0, 2).ok());
  absl::StatusOr<SnapshotInfo> own = dst.cache->Snapshot(0, 0);
  ASSERT_TRUE(own.ok());
  EXPECT_EQ(own->id, 2u);
}

TEST(TransferLifetimeTest, ReaderKeepsTheDataAfterDropMergeAndSplit) {
  const CacheSpec spec =
      Spec(DType::kF16, 4, 32, 16, {Group(Full(), 2, 1, 4, 4, Rope(RopeType::kNormal, 4))});
  TestCache src(spec);
  TestCache dst(spec);
  ASSERT_NE(src.cache, nullptr);
  ASSERT_NE(dst.cache, nullptr);
  Cache& cache = *src.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 10).ok());
  absl::StatusOr<SnapshotInfo> snap = cache.Snapshot(0, 0);
  ASSERT_TRUE(snap.ok());
  absl::StatusOr<Image> before = ExportImage(cache, snap->id);
  ASSERT_TRUE(before.ok());
  absl::StatusOr<std::unique_ptr<SnapshotExportReader>> reader = cache.OpenSnapshotExport(snap->id);
  ASSERT_TRUE(reader.ok());
  // Split, drop the halves, overwrite the sequence and take new snapshots.
  absl::StatusOr<SplitResult> split = cache.SplitSnapshot(snap->id, 4);
  ASSERT_TRUE(split.ok());
  ASSERT_TRUE(cache.DropSnapshot(split->parent->id).ok());
  ASSERT_TRUE(cache.DropSnapshot(split->child->id).ok());
  EXPECT_EQ(cache.Usage().snapshot_bytes, 0u);
  EXPECT_EQ(src.device->used_bytes(MemoryPool::kSnapshot), snap->bytes);  // the reader's
  ASSERT_TRUE(cache.Remove(0, 0, kNoEnd).ok());
  ASSERT_TRUE(AppendRange(cache, 0, 0, 10, /*salt=*/9).ok());
  ASSERT_TRUE(cache.Snapshot(0, 0).ok());
  Image after((*reader)->size());
  ASSERT_TRUE((*reader)->ReadAt(0, absl::MakeSpan(after)).ok());
  EXPECT_TRUE(after == *before);
  EXPECT_EQ((*reader)->info().id, snap->id);
  absl::StatusOr<SnapshotInfo> imported = ImportImage(*dst.cache, after, 13);
  ASSERT_TRUE(imported.ok()) << imported.status();
  ASSERT_TRUE(dst.cache->Restore(0, imported->id, 10).ok());
  EXPECT_TRUE(ReadIs(*dst.cache, 0, 0, kNoEnd, {Range(0, 10)}, {Ids(0, Range(0, 10))}));
  const size_t held = src.device->used_bytes(MemoryPool::kSnapshot);
  reader->reset();
  EXPECT_EQ(src.device->used_bytes(MemoryPool::kSnapshot), held - snap->bytes);
}

// ---- Concurrency ---------------------------------------------------------------------------

TEST(TransferConcurrencyTest, ExportsAndImportsBesideOtherOperations) {
  const CacheSpec spec = HybridSpec();
  TestCache src(spec);
  TestCache dst(spec);
  ASSERT_NE(src.cache, nullptr);
  ASSERT_NE(dst.cache, nullptr);
  constexpr int kMovers = 2;
  constexpr int kRounds = 25;
  std::atomic<bool> done{false};
  // Movers: sequence t of src is rebuilt, snapshotted, exported, dropped, imported into dst
  // (in pieces, while other threads use both caches), restored into dst's sequence t and
  // checked.
  auto mover = [&](int t) {
    for (int round = 0; round < kRounds; ++round) {
      const uint64_t salt = static_cast<uint64_t>(round);
      ASSERT_TRUE(src.cache->Remove(t, 0, kNoEnd).ok());
      ASSERT_TRUE(AppendRange(*src.cache, t, 0, 6, salt).ok());
      absl::StatusOr<SnapshotInfo> snap = src.cache->Snapshot(t, 0);
      ASSERT_TRUE(snap.ok()) << snap.status();
      absl::StatusOr<std::unique_ptr<SnapshotExportReader>> reader =
          src.cache->OpenSnapshotExport(snap->id);
      ASSERT_TRUE(reader.ok()) << reader.status();
      ASSERT_TRUE(src.cache->DropSnapshot(snap->id).ok());
      absl::StatusOr<std::unique_ptr<SnapshotImportWriter>> writer =
          dst.cache->BeginSnapshotImport((*reader)->size());
      ASSERT_TRUE(writer.ok()) << writer.status();
      Image piece(37 + t);
      for (size_t at = 0; at < (*reader)->size();) {
        const size_t n = std::min(piece.size(), (*reader)->size() - at);
        ASSERT_TRUE((*reader)->ReadAt(at, absl::MakeSpan(piece.data(), n)).ok());
        ASSERT_TRUE((*writer)->Write(absl::MakeConstSpan(piece.data(), n)).ok());
        at += n;
      }
      absl::StatusOr<SnapshotInfo> imported = (*writer)->Commit();
      ASSERT_TRUE(imported.ok()) << imported.status();
      ASSERT_TRUE(dst.cache->Restore(t, imported->id, 6).ok());
      EXPECT_TRUE(
          ReadIs(*dst.cache, t, 0, kNoEnd, {Range(2, 6), {}, Range(0, 6)},
                 {Ids(t, Range(2, 6), salt), {StateId(t, 6, salt)}, Ids(t, Range(0, 6), salt)}));
      ASSERT_TRUE(dst.cache->DropSnapshot(imported->id).ok());
    }
  };
  // Other work on sequence 3 of both caches: appends, snapshots, restores, drops, listings.
  auto other = [&] {
    uint64_t salt = 100;
    while (!done.load()) {
      for (Cache* cache : {src.cache.get(), dst.cache.get()}) {
        ASSERT_TRUE(cache->Remove(3, 0, kNoEnd).ok());
        ASSERT_TRUE(AppendRange(*cache, 3, 0, 5, salt).ok());
        absl::StatusOr<SnapshotInfo> snap = cache->Snapshot(3, 0);
        ASSERT_TRUE(snap.ok()) << snap.status();
        ASSERT_TRUE(AppendRange(*cache, 3, 5, 7, salt).ok());
        ASSERT_TRUE(cache->Restore(3, snap->id, 5).ok());
        ASSERT_TRUE(cache->DropSnapshot(snap->id).ok());
        cache->ListSnapshots();
        cache->ListSequences();
        cache->Usage();
      }
      ++salt;
    }
  };
  std::vector<std::thread> threads;
  std::thread background(other);
  for (int t = 0; t < kMovers; ++t) threads.emplace_back(mover, t);
  for (std::thread& thread : threads) thread.join();
  done.store(true);
  background.join();
  EXPECT_TRUE(dst.cache->ListSnapshots().empty());
  EXPECT_EQ(dst.device->used_bytes(MemoryPool::kSnapshot), 0u);
  EXPECT_EQ(src.device->used_bytes(MemoryPool::kSnapshot), 0u);
}

}  // namespace
}  // namespace kvmesh
