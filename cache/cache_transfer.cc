// The Cache's transfers: snapshot and sequence exports and imports between nodes, and read
// cursors (cache/cache.h, "Where things live").
#include "cache/cache.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/container/btree_set.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "cache/attention_group.h"
#include "cache/cache_internal.h"
#include "cache/layer_group.h"
#include "cache/recurrent_group.h"
#include "cache/rotating_group.h"
#include "cache/shortage.h"
#include "cache/snapshot_wire.h"
#include "cache/status_macros.h"

namespace kvmesh {

using cache_internal::CheckNonNegative;

// ---- Moving snapshots between nodes ---------------------------------------------------------

namespace {

// An export reader that counts the bytes it pins in its cache's Usage().export_bytes.
class CountedExportReader final : public SnapshotExportReader {
 public:
  CountedExportReader(std::unique_ptr<SnapshotExportReader> inner,
                      std::shared_ptr<std::atomic<size_t>> counter, size_t bytes)
      : inner_(std::move(inner)), counter_(std::move(counter)), bytes_(bytes) {
    counter_->fetch_add(bytes_);
  }
  ~CountedExportReader() override { counter_->fetch_sub(bytes_); }
  size_t size() const override { return inner_->size(); }
  const SnapshotInfo& info() const override { return inner_->info(); }
  absl::Status ReadAt(size_t offset, absl::Span<uint8_t> dst) override {
    return inner_->ReadAt(offset, dst);
  }
  absl::Span<const uint8_t> View(size_t offset, size_t max_bytes) const override {
    return inner_->View(offset, max_bytes);
  }

 private:
  const std::unique_ptr<SnapshotExportReader> inner_;
  const std::shared_ptr<std::atomic<size_t>> counter_;
  const size_t bytes_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<SnapshotExportReader>> Cache::OpenSnapshotExport(uint64_t id) const {
  SnapshotRecord record;
  SnapshotInfo info;
  std::vector<ChunkFormat> formats;
  {
    ReaderMutexLock lock(&mu_);
    ASSIGN_OR_RETURN(const SnapshotRecord* found, FindSnapshotLocked(id));
    // The copy shares the chunks: they stay alive while the reader exists, whatever happens
    // to the snapshot.
    record = *found;
    info = InfoLocked(record);
    for (const auto& group : groups_) formats.push_back(group->SnapshotChunkFormat());
  }
  const size_t bytes = info.bytes;
  ASSIGN_OR_RETURN(
      std::unique_ptr<SnapshotExportReader> reader,
      NewSnapshotExportReader(spec_, std::move(record), std::move(info), std::move(formats)));
  return std::unique_ptr<SnapshotExportReader>(
      new CountedExportReader(std::move(reader), export_bytes_, bytes));
}

absl::StatusOr<std::unique_ptr<SnapshotImportWriter>> Cache::BeginSnapshotImport(
    size_t total_bytes) {
  const size_t min_bytes = MinSnapshotHeaderBytes(spec_);
  if (total_bytes < min_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "total_bytes = ", total_bytes, " is smaller than the smallest snapshot image (", min_bytes,
        " bytes) of cache '", spec_.name, "'"));
  }
  std::vector<ChunkFormat> formats;
  {
    ReaderMutexLock lock(&mu_);
    for (const auto& group : groups_) formats.push_back(group->SnapshotChunkFormat());
  }
  // The writer allocates and fills its chunks without the lock; only Commit takes it.
  return NewSnapshotImportWriter(spec_, std::move(formats), total_bytes,
                                 [this](SnapshotRecord record) {
                                   MutexLock lock(&mu_);
                                   return AddSnapshotLocked(std::move(record));
                                 });
}

// ---- Moving a sequence without a snapshot copy ---------------------------------------------

void Cache::UnpinCells(size_t group, absl::Span<const int32_t> cells) {
  MutexLock lock(&mu_);
  groups_[group]->Unpin(cells);
}

void Cache::EndRead(int64_t seq) {
  MutexLock lock(&mu_);
  auto it = read_pins_.find(seq);
  if (it != read_pins_.end() && --it->second == 0) read_pins_.erase(it);
}

absl::StatusOr<std::unique_ptr<SnapshotExportReader>> Cache::OpenSequenceExport(
    const std::shared_ptr<Cache>& cache, int64_t seq, int32_t from_offset,
    std::optional<int32_t> to, int32_t require_offset) {
  Cache& c = *cache;
  if (!c.lends_cells_) {
    ASSIGN_OR_RETURN(const SnapshotInfo taken,
                     c.SnapshotRequiring(seq, from_offset, to, require_offset));
    absl::StatusOr<std::unique_ptr<SnapshotExportReader>> reader = c.OpenSnapshotExport(taken.id);
    // The reader shares the snapshot's chunks: the snapshot itself can go.
    (void)c.DropSnapshot(taken.id);
    return reader;
  }
  RETURN_IF_ERROR(c.CheckSnapshotArgs(seq, from_offset, to));
  SnapshotRecord record;
  SnapshotInfo info;
  std::vector<ChunkFormat> formats;
  {
    MutexLock lock(&c.mu_);
    RETURN_IF_ERROR(c.CheckOffsetAtLeastLocked(seq, require_offset));
    ASSIGN_OR_RETURN(const int32_t end, c.CheckSnapshotLocked(seq, from_offset, to));
    record = c.PinRecordLocked(cache, seq, from_offset, end, &formats);
    if (const TokenChain* chain = c.tokens_.Find(seq); chain != nullptr) {
      record.tokens = chain->Prefix(end);
    }
    info = c.InfoLocked(record);
  }
  const size_t bytes = info.bytes;
  ASSIGN_OR_RETURN(
      std::unique_ptr<SnapshotExportReader> reader,
      NewSnapshotExportReader(c.spec_, std::move(record), std::move(info), std::move(formats)));
  return std::unique_ptr<SnapshotExportReader>(
      new CountedExportReader(std::move(reader), c.export_bytes_, bytes));
}

SnapshotRecord Cache::PinRecordLocked(const std::shared_ptr<Cache>& self, int64_t seq, int32_t from,
                                      int64_t to, std::vector<ChunkFormat>* formats) {
  SnapshotRecord record;
  record.seq = seq;
  record.from = from;
  record.to = static_cast<int32_t>(std::min<int64_t>(to, INT32_MAX));
  // While anything of the record's pins lives, `seq` is read: not evicted (EvictableLocked).
  // Other sequences that share its cells may be.
  std::shared_ptr<void> reading;
  bool counted = false;
  for (size_t g = 0; g < groups_.size(); ++g) {
    LayerGroup& group = *groups_[g];
    std::vector<int32_t> pinned;
    GroupSnapshot snap = group.PinSequence(seq, from, to, &pinned);
    if (!pinned.empty()) {
      if (!counted) {  // one count per record, ended by the last of its groups' pins
        counted = true;
        ++read_pins_[seq];
        reading = std::shared_ptr<void>(nullptr, [self, seq](void*) { self->EndRead(seq); });
      }
      // The last reference to the borrowed cells unpins them, outside the cache's lock: a
      // reader or cursor and the slices of a transfer hold them, never an operation of the
      // cache.
      std::shared_ptr<const RowChunk> cells(
          new RowChunk(group.BorrowCells()),
          [self, g, pinned = std::move(pinned), reading](const RowChunk* chunk) {
            self->UnpinCells(g, pinned);
            delete chunk;
          });
      for (Segment& segment : snap.segments) segment.chunk = cells;
    }
    record.groups.push_back(std::move(snap));
    formats->push_back(group.SnapshotChunkFormat());
  }
  return record;
}

namespace {

absl::Status CheckPayloadRange(size_t offset, size_t bytes, size_t size) {
  if (offset <= size && bytes <= size - offset) return absl::OkStatus();
  return absl::OutOfRangeError(absl::StrCat("ReadAt of ", bytes, " bytes at offset ", offset,
                                            " goes past the end of the ", size, "-byte payload"));
}

// A Read's payload as the data part of a wire image over pinned cells: for each group, each
// plane's rows in position order, which is Read's layout.
class PinnedReadCursor final : public ReadCursor {
 public:
  PinnedReadCursor(ReadResult header, std::unique_ptr<SnapshotExportReader> image,
                   size_t data_begin)
      : header_(std::move(header)), image_(std::move(image)), data_begin_(data_begin) {}
  const ReadResult& header() const override { return header_; }
  size_t size() const override { return image_->size() - data_begin_; }
  absl::Status ReadAt(size_t offset, absl::Span<uint8_t> dst) override {
    RETURN_IF_ERROR(CheckPayloadRange(offset, dst.size(), size()));
    return image_->ReadAt(data_begin_ + offset, dst);
  }
  absl::Span<const uint8_t> View(size_t offset, size_t max_bytes) const override {
    if (offset >= size()) return {};
    return image_->View(data_begin_ + offset, std::min(max_bytes, size() - offset));
  }

 private:
  const ReadResult header_;
  const std::unique_ptr<SnapshotExportReader> image_;
  const size_t data_begin_;
};

// A Read done at once, its payload kept.
class CopiedReadCursor final : public ReadCursor {
 public:
  explicit CopiedReadCursor(ReadResult result) : result_(std::move(result)) {}
  const ReadResult& header() const override { return result_; }
  size_t size() const override { return result_.payload.size(); }
  absl::Status ReadAt(size_t offset, absl::Span<uint8_t> dst) override {
    RETURN_IF_ERROR(CheckPayloadRange(offset, dst.size(), size()));
    if (!dst.empty()) std::memcpy(dst.data(), result_.payload.data() + offset, dst.size());
    return absl::OkStatus();
  }
  absl::Span<const uint8_t> View(size_t offset, size_t max_bytes) const override {
    if (offset >= size()) return {};
    return absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(result_.payload.data()),
                                     result_.payload.size())
        .subspan(offset, max_bytes);
  }

 private:
  const ReadResult result_;
};

}  // namespace

std::unique_ptr<ReadCursor> NewCopiedReadCursor(ReadResult result) {
  return std::make_unique<CopiedReadCursor>(std::move(result));
}

absl::StatusOr<std::vector<Cache::SharedGroup>> Cache::SharedGroups() const {
  ReaderMutexLock lock(&mu_);
  std::vector<SharedGroup> out;
  for (const auto& group : groups_) {
    const RowChunk cells = group->BorrowCells();
    SharedGroup shared;
    shared.kind = group->kind();
    ASSIGN_OR_RETURN(shared.memory, group->device()->Share(cells.arena));
    shared.planes = cells.planes;
    shared.cells = group->Usage().cells_total;
    out.push_back(std::move(shared));
  }
  return out;
}

absl::StatusOr<Cache::PinnedCells> Cache::PinCells(const std::shared_ptr<Cache>& cache, int64_t seq,
                                                   int32_t begin, std::optional<int32_t> end,
                                                   absl::Span<const int32_t> queries) {
  Cache& c = *cache;
  if (!c.pins_in_place_) {
    return absl::FailedPreconditionError(
        absl::StrCat("cache '", c.spec_.name, "' has a group that cannot pin rows in place"));
  }
  RETURN_IF_ERROR(c.CheckReadArgs(seq, begin, end));
  for (size_t i = 0; i < queries.size(); ++i) {
    if (queries[i] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("queries[", i, "] = ", queries[i], " is negative"));
    }
  }
  auto record = std::make_shared<SnapshotRecord>();
  const int64_t stop = end.has_value() ? int64_t{*end} : int64_t{INT32_MAX} + 1;
  PinnedCells pinned;
  {
    MutexLock lock(&c.mu_);
    RETURN_IF_ERROR(c.CheckUsableLocked());
    if (!c.IsLiveLocked(seq)) {
      return absl::NotFoundError(absl::StrCat("cache '", c.spec_.name, "' has no sequence ", seq));
    }
    for (const auto& group : c.groups_) RETURN_IF_ERROR(group->CheckPin(seq, begin, stop));
    if (!queries.empty()) {
      // Counted until it passes the limit (so it cannot overflow), each query at least once.
      int64_t bound = 0;
      for (size_t g = 0; g < c.groups_.size() && bound <= kMaxPinVisibleRanges; ++g) {
        for (size_t i = 0; i < queries.size() && bound <= kMaxPinVisibleRanges; ++i) {
          bound += std::max<int64_t>(1, c.groups_[g]->VisibleRangesBound(Query{seq, queries[i]}));
        }
      }
      if (bound > kMaxPinVisibleRanges) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "the ", queries.size(), " queries could attend to more than ", kMaxPinVisibleRanges,
            " ranges of positions over the cache's ", c.groups_.size(),
            " groups, the most a pin answers: pin with fewer "
            "queries"));
      }
      for (const auto& group : c.groups_) {
        std::vector<std::vector<PositionRange>>& per_query = pinned.visible.emplace_back();
        per_query.resize(queries.size());
        for (size_t i = 0; i < queries.size(); ++i) {
          std::vector<PositionRange> ranges;
          group->VisibleRanges(Query{seq, queries[i]}, &ranges);
          for (PositionRange r : ranges) {  // cut to the pinned [begin, stop)
            r.first = std::max(r.first, begin);
            if (int64_t{r.last} >= stop) r.last = static_cast<int32_t>(stop - 1);
            if (r.first <= r.last) per_query[i].push_back(r);
          }
        }
      }
    }
    std::vector<ChunkFormat> formats;
    *record = c.PinRecordLocked(cache, seq, begin, stop, &formats);
    c.TouchLocked({seq});
  }
  for (const GroupSnapshot& g : record->groups) {
    std::vector<int32_t> positions;
    std::vector<int32_t> cells;
    for (const Segment& segment : g.segments) {
      positions.insert(positions.end(), segment.positions.begin(), segment.positions.end());
      cells.insert(cells.end(), segment.chunk_rows.begin(), segment.chunk_rows.end());
    }
    pinned.positions.push_back(std::move(positions));
    pinned.cells.push_back(std::move(cells));
  }
  pinned.hold = std::move(record);
  return pinned;
}

absl::StatusOr<std::unique_ptr<ReadCursor>> Cache::OpenRead(const std::shared_ptr<Cache>& cache,
                                                            int64_t seq, int32_t begin,
                                                            std::optional<int32_t> end) {
  Cache& c = *cache;
  if (!c.lends_cells_) {
    ASSIGN_OR_RETURN(ReadResult result, c.Read(seq, begin, end));
    // Its header() has the payload too; callers use size() and ReadAt.
    return NewCopiedReadCursor(std::move(result));
  }
  RETURN_IF_ERROR(c.CheckReadArgs(seq, begin, end));
  SnapshotRecord record;
  SnapshotInfo info;
  std::vector<ChunkFormat> formats;
  {
    MutexLock lock(&c.mu_);
    RETURN_IF_ERROR(c.CheckUsableLocked());
    if (!c.IsLiveLocked(seq)) {
      return absl::NotFoundError(absl::StrCat("cache '", c.spec_.name, "' has no sequence ", seq));
    }
    const int64_t stop = end.has_value() ? int64_t{*end} : int64_t{INT32_MAX} + 1;
    record = c.PinRecordLocked(cache, seq, begin, stop, &formats);
    info = c.InfoLocked(record);
    c.TouchLocked({seq});
  }
  ReadResult header;
  for (const GroupSnapshot& g : record.groups) {
    std::vector<int32_t> positions;
    for (const Segment& segment : g.segments) {
      positions.insert(positions.end(), segment.positions.begin(), segment.positions.end());
    }
    header.positions.push_back(std::move(positions));
    header.states.push_back(StateStatus::kNone);
  }
  // The image's header is not part of the payload: the data follows it.
  const size_t data_bytes = info.bytes;
  ASSIGN_OR_RETURN(
      std::unique_ptr<SnapshotExportReader> image,
      NewSnapshotExportReader(c.spec_, std::move(record), std::move(info), std::move(formats)));
  const size_t data_begin = image->size() - data_bytes;
  return std::unique_ptr<ReadCursor>(
      new PinnedReadCursor(std::move(header), std::move(image), data_begin));
}

struct SequenceImport::State {
  // Guarded by the cache's lock once the writer exists.
  std::vector<std::vector<int32_t>> pinned;  // per group, the cells the import pinned
  bool in_cells = false;
  bool committed = false;
  bool used = false;      // by RestoreImport
  SnapshotRecord record;  // once committed
};

SequenceImport::~SequenceImport() {
  writer_.reset();
  for (size_t g = 0; g < state_->pinned.size(); ++g) {
    if (!state_->pinned[g].empty()) cache_->UnpinCells(g, state_->pinned[g]);
  }
}

bool SequenceImport::in_cells() const {
  ReaderMutexLock lock(&cache_->mu_);
  return state_->in_cells;
}

absl::StatusOr<bool> Cache::PlaceImport(SequenceImport::State& state, SnapshotRecord* record) {
  MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckUsableLocked());
  // The import's sequence is not known yet: every room reservation is held back.
  const HeldBack held = HoldBackLocked({});
  std::vector<std::vector<int32_t>> pinned(groups_.size());
  for (size_t g = 0; g < groups_.size(); ++g) {
    const int32_t rows = record->groups[g].stored();
    if (rows == 0) continue;
    pinned[g] = groups_[g]->PinFreeCells(rows);
    if (pinned[g].size() == static_cast<size_t>(rows)) continue;
    // Too few free cells now: the rows go to the snapshot pool, and the Restore copies them
    // (maybe into cells that the sequence's own old ones free).
    for (size_t h = 0; h < g; ++h) groups_[h]->Unpin(pinned[h]);
    return false;
  }
  for (size_t g = 0; g < groups_.size(); ++g) {
    if (pinned[g].empty()) continue;
    auto cells = std::make_shared<RowChunk>(groups_[g]->BorrowCells());
    size_t next = 0;
    for (Segment& segment : record->groups[g].segments) {
      segment.chunk = cells;
      segment.chunk_rows.assign(pinned[g].begin() + next, pinned[g].begin() + next + segment.rows);
      next += static_cast<size_t>(segment.rows);
    }
  }
  state.pinned = std::move(pinned);
  state.in_cells = true;
  return true;
}

SnapshotInfo Cache::CommitImport(SequenceImport::State& state, SnapshotRecord record) {
  MutexLock lock(&mu_);
  SnapshotInfo info = InfoLocked(record);
  state.record = std::move(record);
  state.committed = true;
  return info;
}

absl::StatusOr<std::unique_ptr<SequenceImport>> Cache::BeginSequenceImport(
    const std::shared_ptr<Cache>& cache, size_t total_bytes) {
  Cache& c = *cache;
  const size_t min_bytes = MinSnapshotHeaderBytes(c.spec_);
  if (total_bytes < min_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "total_bytes = ", total_bytes, " is smaller than the smallest snapshot image (", min_bytes,
        " bytes) of cache '", c.spec_.name, "'"));
  }
  auto state = std::make_shared<SequenceImport::State>();
  std::vector<ChunkFormat> formats;
  {
    ReaderMutexLock lock(&c.mu_);
    for (const auto& group : c.groups_) formats.push_back(group->SnapshotChunkFormat());
  }
  // The callbacks run on the writer's thread while the import (which holds the cache) exists.
  SnapshotPlaceFn place;
  if (c.lends_cells_) {
    place = [&c, state](SnapshotRecord* record) { return c.PlaceImport(*state, record); };
  }
  SnapshotCommitFn commit = [&c, state](SnapshotRecord record) {
    return c.CommitImport(*state, std::move(record));
  };
  std::unique_ptr<SequenceImport> import(new SequenceImport(cache, state));
  import->writer_ = NewSnapshotImportWriter(c.spec_, std::move(formats), total_bytes,
                                            std::move(commit), std::move(place));
  return import;
}

absl::Status Cache::RestoreImport(int64_t seq, SequenceImport& import, int32_t target,
                                  const RestoreOptions& options) {
  RETURN_IF_ERROR(ValidateSeq(seq));
  RETURN_IF_ERROR(CheckNonNegative("target", target));
  if (options.retention.has_value()) RETURN_IF_ERROR(RetentionIndex::Validate(*options.retention));
  if (import.cache_.get() != this) {
    return absl::FailedPreconditionError(
        absl::StrCat("the import was begun on another cache than '", spec_.name, "'"));
  }
  SequenceImport::State& state = *import.state_;
  MutexLock lock(&mu_);
  if (!state.committed || state.used) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the import into cache '", spec_.name, "' ", state.used ? "was used" : "is not committed"));
  }
  AwaitNotAppendingLocked({seq});
  RETURN_IF_ERROR(CheckUsableLocked());
  RETURN_IF_ERROR(CheckNotPendingLocked(seq, "Restore"));
  const absl::Status status = RestoreLocked(seq, &state.record, target, options);
  // A refusal changed nothing, and the import may be restored still. Otherwise it is used up:
  // the sequence took the cells it restored, and the others are free again.
  if (!status.ok() && device_failure_.ok()) return status;
  state.used = true;
  for (size_t g = 0; g < state.pinned.size(); ++g) groups_[g]->Unpin(state.pinned[g]);
  state.pinned.clear();
  state.record = SnapshotRecord();
  return status;
}

}  // namespace kvmesh
