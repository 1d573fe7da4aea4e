#include "cache/snapshot_wire.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "cache/shortage.h"
#include "cache/status_macros.h"

namespace kvmesh {

namespace {

constexpr char kImage[] = "snapshot image: ";

absl::Status Malformed(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(kImage, what));
}

// ---- Little-endian encoding ----------------------------------------------------------------

void PutU32(std::vector<uint8_t>* out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out->push_back(static_cast<uint8_t>(v >> (8 * i)));
}
void PutU64(std::vector<uint8_t>* out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out->push_back(static_cast<uint8_t>(v >> (8 * i)));
}
void PutI32(std::vector<uint8_t>* out, int32_t v) { PutU32(out, static_cast<uint32_t>(v)); }
void PutI64(std::vector<uint8_t>* out, int64_t v) { PutU64(out, static_cast<uint64_t>(v)); }
void StoreU32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
void StoreU64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint32_t LoadU32(const uint8_t* p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}
uint64_t LoadU64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// Reads the header's fields in order; running past the header is INVALID_ARGUMENT naming the
// field that did not fit.
class Decoder {
 public:
  Decoder(absl::Span<const uint8_t> header, size_t offset) : header_(header), offset_(offset) {}

  size_t offset() const { return offset_; }
  size_t remaining() const { return header_.size() - offset_; }

  absl::StatusOr<uint32_t> U32(absl::string_view field) {
    RETURN_IF_ERROR(Need(4, field));
    const uint32_t v = LoadU32(header_.data() + offset_);
    offset_ += 4;
    return v;
  }
  absl::StatusOr<uint64_t> U64(absl::string_view field) {
    RETURN_IF_ERROR(Need(8, field));
    const uint64_t v = LoadU64(header_.data() + offset_);
    offset_ += 8;
    return v;
  }
  absl::StatusOr<int32_t> I32(absl::string_view field) {
    ASSIGN_OR_RETURN(uint32_t v, U32(field));
    return static_cast<int32_t>(v);
  }
  absl::StatusOr<int64_t> I64(absl::string_view field) {
    ASSIGN_OR_RETURN(uint64_t v, U64(field));
    return static_cast<int64_t>(v);
  }

 private:
  absl::Status Need(size_t bytes, absl::string_view field) const {
    if (remaining() >= bytes) return absl::OkStatus();
    return Malformed(absl::StrCat("the header ends (header_bytes = ", header_.size(), ") before ",
                                  field, " at offset ", offset_));
  }

  absl::Span<const uint8_t> header_;
  size_t offset_;
};

// ---- Spec codes ----------------------------------------------------------------------------
// Fixed codes, so that the encoding does not depend on the order of enumerators.

uint32_t DTypeCode(DType t) {
  switch (t) {
    case DType::kF32:
      return 0;
    case DType::kF16:
      return 1;
    case DType::kBF16:
      return 2;
  }
  return 0xFFFFFFFFu;
}

uint32_t KindCode(GroupKind kind) {
  switch (kind) {
    case GroupKind::kAttention:
      return 0;
    case GroupKind::kRotating:
      return 1;
    case GroupKind::kRecurrent:
      return 2;
  }
  return 0xFFFFFFFFu;
}

uint32_t WindowCode(WindowKind kind) {
  switch (kind) {
    case WindowKind::kFull:
      return 0;
    case WindowKind::kSliding:
      return 1;
    case WindowKind::kChunked:
      return 2;
  }
  return 0xFFFFFFFFu;
}

uint32_t RopeCode(RopeType type) {
  switch (type) {
    case RopeType::kNone:
      return 0;
    case RopeType::kNormal:
      return 1;
    case RopeType::kNeox:
      return 2;
  }
  return 0xFFFFFFFFu;
}

uint32_t FloatBits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
}

void PutRope(std::vector<uint8_t>* out, const RopeSpec& rope) {
  PutU32(out, RopeCode(rope.type));
  const bool none = rope.type == RopeType::kNone;
  PutI32(out, none ? 0 : rope.dims);
  PutU32(out, none ? 0 : FloatBits(rope.base));
  PutU32(out, none ? 0 : FloatBits(rope.freq_scale));
}

size_t PlaneCount(const GroupSpec& g) {
  return g.kind == GroupKind::kRecurrent ? size_t(g.num_layers) : 2 * size_t(g.num_layers);
}

// Header bytes of group `g` with no segments.
size_t GroupFixedBytes(const GroupSpec& g) { return 5 * 4 + 8 * PlaneCount(g); }

constexpr size_t kSnapshotFixedBytes = 8 + 4 + 4 + 4;  // seq, from, to, num_groups

size_t Sum(const std::vector<size_t>& v) { return std::accumulate(v.begin(), v.end(), size_t{0}); }

// ---- Where the data rows lie ---------------------------------------------------------------

// One segment's rows in the image: [begin, end), plane after plane.
struct DataSegment {
  size_t begin = 0;
  size_t end = 0;
  const RowChunk* chunk = nullptr;
  int32_t first_row = 0;
  int32_t rows = 0;
  const std::vector<size_t>* row_bytes = nullptr;  // the group's ChunkFormat::row_bytes
  const int32_t* chunk_rows = nullptr;             // Segment::chunk_rows, when not empty

  int32_t ChunkRow(size_t i) const {
    return chunk_rows != nullptr ? chunk_rows[i] : first_row + static_cast<int32_t>(i);
  }
};

// The row of the image that holds a given byte.
struct RowRef {
  size_t segment = 0;
  size_t plane = 0;
  int32_t row = 0;  // in the chunk
  size_t begin = 0;
  size_t bytes = 0;
};

// The data part of an image as a list of segments, to find rows and runs of rows by offset.
class DataMap {
 public:
  explicit DataMap(size_t begin = 0) : end_(begin) {}

  // Appends a segment of `rows` rows of `row_bytes` planes at the current end.
  void Add(const Segment& s, const std::vector<size_t>* row_bytes) {
    const size_t bytes = size_t(s.rows) * Sum(*row_bytes);
    if (bytes == 0) return;
    segments_.push_back(DataSegment{end_, end_ + bytes, s.chunk.get(), s.first_row, s.rows,
                                    row_bytes,
                                    s.chunk_rows.empty() ? nullptr : s.chunk_rows.data()});
    end_ += bytes;
  }

  size_t end() const { return end_; }
  const DataSegment& segment(size_t i) const { return segments_[i]; }

  // REQUIRES: `at` lies in a segment.
  RowRef Locate(size_t at) const {
    RowRef ref;
    ref.segment = SegmentAt(at);
    const DataSegment& s = segments_[ref.segment];
    const std::vector<size_t>& rb = *s.row_bytes;
    size_t start = s.begin;
    while (start + size_t(s.rows) * rb[ref.plane] <= at) start += size_t(s.rows) * rb[ref.plane++];
    const size_t index = (at - start) / rb[ref.plane];
    ref.row = s.ChunkRow(index);
    ref.bytes = rb[ref.plane];
    ref.begin = start + index * ref.bytes;
    return ref;
  }

  // Where the rows of `ref`'s plane in its segment start in the image.
  size_t PlaneBegin(const RowRef& ref) const {
    const DataSegment& s = segments_[ref.segment];
    size_t start = s.begin;
    for (size_t p = 0; p < ref.plane; ++p) start += size_t(s.rows) * (*s.row_bytes)[p];
    return start;
  }

  // The last row boundary at or before `at` (the end of the data is one).
  size_t AlignDown(size_t at) const {
    if (segments_.empty() || at >= end_) return at;
    if (at < segments_.front().begin) return at;
    return Locate(at).begin;
  }

  // For [a, b), both row boundaries: fn(chunk, planes, rows, image offset of the run's first
  // byte) for each run of rows that one Gather or Scatter moves (whole consecutive planes of a
  // segment, or a range of rows of one plane).
  template <typename Fn>
  absl::Status ForEachRun(size_t a, size_t b, Fn fn) const {
    if (a >= b) return absl::OkStatus();
    size_t si = SegmentAt(a);
    std::vector<int32_t> rows;
    while (a < b) {
      const DataSegment& s = segments_[si];
      if (a >= s.end) {
        ++si;
        continue;
      }
      const std::vector<size_t>& rb = *s.row_bytes;
      const size_t n = size_t(s.rows);
      size_t p = 0, start = s.begin;
      while (start + n * rb[p] <= a) start += n * rb[p++];
      const size_t limit = std::min(b, s.end);
      const size_t r0 = (a - start) / rb[p];
      if (r0 == 0) {
        size_t q = p, stop = start;
        while (q < rb.size() && stop + n * rb[q] <= limit) stop += n * rb[q++];
        if (q > p) {
          rows.resize(n);
          for (size_t i = 0; i < n; ++i) rows[i] = s.ChunkRow(i);
          RETURN_IF_ERROR(fn(*s.chunk, absl::MakeConstSpan(s.chunk->planes).subspan(p, q - p),
                             absl::MakeConstSpan(rows), a));
          a = stop;
          continue;
        }
      }
      const size_t r1 = std::min(n, r0 + (limit - a) / rb[p]);
      if (r1 == r0) {
        return absl::InternalError(
            absl::StrCat(kImage, "data range ends inside a row at offset ", limit));
      }
      rows.resize(r1 - r0);
      for (size_t i = r0; i < r1; ++i) rows[i - r0] = s.ChunkRow(i);
      RETURN_IF_ERROR(fn(*s.chunk, absl::MakeConstSpan(s.chunk->planes).subspan(p, 1),
                         absl::MakeConstSpan(rows), a));
      a += (r1 - r0) * rb[p];
    }
    return absl::OkStatus();
  }

 private:
  size_t SegmentAt(size_t at) const {
    auto it = std::upper_bound(segments_.begin(), segments_.end(), at,
                               [](size_t x, const DataSegment& s) { return x < s.begin; });
    return static_cast<size_t>(it - segments_.begin()) - 1;
  }

  std::vector<DataSegment> segments_;
  size_t end_;
};

// ---- Export --------------------------------------------------------------------------------

class ExportReader final : public SnapshotExportReader {
 public:
  ExportReader(SnapshotInfo info, SnapshotRecord record, std::vector<ChunkFormat> formats)
      : info_(std::move(info)), record_(std::move(record)), formats_(std::move(formats)) {}

  // Checks the chunks, encodes the header and maps the data.
  absl::Status Init(const CacheSpec& spec) {
    if (formats_.size() != record_.groups.size() || formats_.size() != spec.groups.size()) {
      return absl::InternalError(absl::StrCat(kImage, "snapshot ", record_.id, " has ",
                                              record_.groups.size(), " groups, the cache ",
                                              formats_.size()));
    }
    device_ = formats_.empty() ? nullptr : formats_[0].device;
    std::vector<uint8_t>& h = header_;
    h.insert(h.end(), kSnapshotWireMagic, kSnapshotWireMagic + sizeof(kSnapshotWireMagic));
    // Version 1 when there are no token ids, so that nodes that read only version 1 take it.
    const TokenIds& tokens = record_.tokens;
    const bool with_tokens = !tokens.ids.empty() || tokens.taint != kNoTaint;
    PutU32(&h, with_tokens ? kSnapshotWireVersion : 1);
    PutU32(&h, 0);  // header_bytes, below
    PutU64(&h, 0);  // total_bytes, below
    PutU64(&h, SpecFingerprint(spec));
    PutI64(&h, record_.seq);
    PutI32(&h, record_.from);
    PutI32(&h, record_.to);
    PutU32(&h, static_cast<uint32_t>(record_.groups.size()));
    size_t data_bytes = 0;
    for (size_t g = 0; g < record_.groups.size(); ++g) {
      const GroupSnapshot& gs = record_.groups[g];
      const std::vector<size_t>& rb = formats_[g].row_bytes;
      const GroupKind kind = spec.groups[g].kind;
      PutU32(&h, KindCode(kind));
      PutI32(&h, gs.ring_index);
      PutU32(&h, gs.has_state ? 1 : 0);
      PutU32(&h, static_cast<uint32_t>(rb.size()));
      for (size_t bytes : rb) PutU64(&h, bytes);
      uint32_t segments = 0;
      for (const Segment& s : gs.segments) segments += s.rows > 0;
      PutU32(&h, segments);
      for (const Segment& s : gs.segments) {
        if (s.rows <= 0) continue;
        if (s.chunk == nullptr || s.chunk->planes.size() != rb.size()) {
          return absl::InternalError(absl::StrCat(kImage, "snapshot ", record_.id, " group ", g,
                                                  " has a chunk of another format"));
        }
        for (size_t p = 0; p < rb.size(); ++p) {
          if (s.chunk->planes[p].row_bytes != rb[p]) {
            return absl::InternalError(
                absl::StrCat(kImage, "snapshot ", record_.id, " group ", g, " plane ", p,
                             " has rows of ", s.chunk->planes[p].row_bytes, " bytes, not ", rb[p]));
          }
        }
        const bool has_positions = kind != GroupKind::kRecurrent;
        if (has_positions && s.positions.size() != size_t(s.rows)) {
          return absl::InternalError(absl::StrCat(kImage, "snapshot ", record_.id, " group ", g,
                                                  " has a segment of ", s.rows, " rows and ",
                                                  s.positions.size(), " positions"));
        }
        PutU32(&h, static_cast<uint32_t>(s.rows));
        if (has_positions) {
          for (int32_t pos : s.positions) PutI32(&h, pos);
        }
        data_bytes += size_t(s.rows) * Sum(rb);
      }
    }
    if (with_tokens) {
      PutU32(&h, static_cast<uint32_t>(tokens.ids.size()));
      PutI32(&h, tokens.taint == kNoTaint ? -1 : tokens.taint);
      for (int32_t id : tokens.ids) PutI32(&h, id);
    }
    if (h.size() > std::numeric_limits<uint32_t>::max()) {
      return absl::FailedPreconditionError(absl::StrCat(kImage, "the header of snapshot ",
                                                        record_.id, " would be ", h.size(),
                                                        " bytes, more than the format's 4 GiB"));
    }
    size_ = h.size() + data_bytes;
    StoreU32(h.data() + 12, static_cast<uint32_t>(h.size()));
    StoreU64(h.data() + 16, size_);
    map_ = DataMap(h.size());
    for (size_t g = 0; g < record_.groups.size(); ++g) {
      for (const Segment& s : record_.groups[g].segments) {
        if (s.rows > 0) map_.Add(s, &formats_[g].row_bytes);
      }
    }
    return absl::OkStatus();
  }

  size_t size() const override { return size_; }
  const SnapshotInfo& info() const override { return info_; }

  absl::Span<const uint8_t> View(size_t offset, size_t max_bytes) const override {
    if (offset >= size_ || max_bytes == 0) return {};
    if (offset < header_.size()) {
      return {header_.data() + offset, std::min(max_bytes, header_.size() - offset)};
    }
    const RowRef row = map_.Locate(offset);
    const DataSegment& s = map_.segment(row.segment);
    const uint8_t* base = device_->HostAddress(s.chunk->arena);
    if (base == nullptr) return {};
    // The plane's rows of the segment lie one after another in the image; in the arena, those
    // of consecutive chunk rows do.
    const size_t index = (row.begin - map_.PlaneBegin(row)) / row.bytes;
    size_t run = size_t(s.rows) - index;
    if (s.chunk_rows != nullptr) {
      // Rows that max_bytes reaches into (saturating: max_bytes may be SIZE_MAX).
      const size_t reach = max_bytes > SIZE_MAX - (offset - row.begin) - row.bytes
                               ? SIZE_MAX
                               : offset - row.begin + max_bytes + row.bytes - 1;
      const size_t wanted = reach / row.bytes;
      const size_t limit = std::min(run, wanted);
      run = 1;
      while (run < limit && s.chunk_rows[index + run] == row.row + static_cast<int32_t>(run)) ++run;
    }
    const size_t plane_end = row.begin + run * row.bytes;
    const uint8_t* at = base + s.chunk->planes[row.plane].offset + size_t(row.row) * row.bytes +
                        (offset - row.begin);
    return {at, std::min(max_bytes, plane_end - offset)};
  }

  absl::Status ReadAt(size_t offset, absl::Span<uint8_t> dst) override {
    if (offset > size_ || dst.size() > size_ - offset) {
      return absl::OutOfRangeError(absl::StrCat("ReadAt of ", dst.size(), " bytes at offset ",
                                                offset, " goes past the end of the ", size_,
                                                "-byte image of snapshot ", info_.id));
    }
    if (dst.empty()) return absl::OkStatus();
    size_t at = offset;
    const size_t end = offset + dst.size();
    uint8_t* out = dst.data();
    if (at < header_.size()) {
      const size_t n = std::min(end, header_.size()) - at;
      std::memcpy(out, header_.data() + at, n);
      at += n;
    }
    while (at < end) {
      const RowRef row = map_.Locate(at);
      if (at != row.begin || row.begin + row.bytes > end) {
        // A piece of one row: gather the row, copy the piece.
        const DataSegment& s = map_.segment(row.segment);
        row_.resize(row.bytes);
        RETURN_IF_ERROR(device_->Gather(s.chunk->arena, {&s.chunk->planes[row.plane], 1},
                                        {&row.row, 1}, row_.data()));
        const size_t n = std::min(end, row.begin + row.bytes) - at;
        std::memcpy(out + (at - offset), row_.data() + (at - row.begin), n);
        at += n;
        continue;
      }
      const size_t stop = map_.AlignDown(end);
      RETURN_IF_ERROR(map_.ForEachRun(at, stop,
                                      [&](const RowChunk& chunk, absl::Span<const Plane> planes,
                                          absl::Span<const int32_t> rows, size_t run_at) {
                                        return device_->Gather(chunk.arena, planes, rows,
                                                               out + (run_at - offset));
                                      }));
      at = stop;
    }
    return absl::OkStatus();
  }

 private:
  const SnapshotInfo info_;
  const SnapshotRecord record_;  // its segments keep the chunks alive
  const std::vector<ChunkFormat> formats_;
  Device* device_ = nullptr;
  std::vector<uint8_t> header_;
  size_t size_ = 0;
  DataMap map_;
  std::vector<uint8_t> row_;  // one row, for reads that start or end inside it
};

// ---- Import --------------------------------------------------------------------------------

class ImportWriter final : public SnapshotImportWriter {
 public:
  ImportWriter(const CacheSpec& spec, std::vector<ChunkFormat> formats, size_t total_bytes,
               SnapshotCommitFn commit, SnapshotPlaceFn place)
      : spec_(spec),
        formats_(std::move(formats)),
        total_(total_bytes),
        commit_(std::move(commit)),
        place_(std::move(place)) {
    for (const ChunkFormat& f : formats_) {
      for (size_t bytes : f.row_bytes) staging_capacity_ = std::max(staging_capacity_, bytes);
    }
  }

  size_t written() const override { return written_; }

  absl::Status Write(absl::Span<const uint8_t> bytes) override {
    RETURN_IF_ERROR(error_);
    if (committed_) return absl::FailedPreconditionError("the snapshot import was committed");
    if (bytes.size() > total_ - written_) {
      return Fail(absl::InvalidArgumentError(
          absl::StrCat(kImage, "a write of ", bytes.size(), " bytes at offset ", written_,
                       " goes past total_bytes = ", total_, " announced for the import")));
    }
    while (!bytes.empty()) {
      if (!header_done_) {
        const size_t target = header_bytes_ == 0 ? kSnapshotWirePreambleBytes : header_bytes_;
        const size_t n = std::min(bytes.size(), target - header_.size());
        header_.insert(header_.end(), bytes.begin(), bytes.begin() + n);
        written_ += n;
        bytes.remove_prefix(n);
        if (header_.size() < target) break;
        if (header_bytes_ == 0) {
          RETURN_IF_ERROR(Fail(ReadPreamble()));
          if (header_.size() < header_bytes_) continue;
        }
        RETURN_IF_ERROR(Fail(ReadHeader()));
        continue;
      }
      // Data. A write that brings a large run of whole rows goes to the device directly.
      if (staging_.empty()) {
        const size_t stop = map_.AlignDown(written_ + bytes.size());
        if (stop > written_ && stop - written_ >= staging_capacity_) {
          const size_t base = written_;
          RETURN_IF_ERROR(Fail(Scatter(written_, stop, bytes.data(), base)));
          bytes.remove_prefix(stop - written_);
          written_ = stop;
          staged_begin_ = stop;
          continue;
        }
      }
      const size_t n = std::min(bytes.size(), staging_capacity_ - staging_.size());
      staging_.insert(staging_.end(), bytes.begin(), bytes.begin() + n);
      written_ += n;
      bytes.remove_prefix(n);
      if (staging_.size() == staging_capacity_ || written_ == total_) {
        RETURN_IF_ERROR(Fail(Flush()));
      }
    }
    return absl::OkStatus();
  }

  absl::StatusOr<SnapshotInfo> Commit() override {
    RETURN_IF_ERROR(error_);
    if (committed_) return absl::FailedPreconditionError("the snapshot import was committed");
    if (written_ != total_ || !header_done_) {
      return Fail(absl::FailedPreconditionError(
          absl::StrCat(kImage, "Commit after ", written_, " of the ", total_,
                       " bytes announced (total_bytes); the image is incomplete")));
    }
    committed_ = true;
    chunks_.clear();
    return commit_(std::move(record_));
  }

 private:
  // Records the first error and frees everything held: any error is final.
  absl::Status Fail(absl::Status status) {
    if (status.ok()) return status;
    if (error_.ok()) error_ = status;
    record_ = SnapshotRecord();
    chunks_.clear();
    map_ = DataMap();
    std::vector<uint8_t>().swap(staging_);
    std::vector<uint8_t>().swap(header_);
    return error_;
  }

  absl::Status ReadPreamble() {
    const uint8_t* p = header_.data();
    if (std::memcmp(p, kSnapshotWireMagic, sizeof(kSnapshotWireMagic)) != 0) {
      return Malformed(absl::StrCat("magic is 0x", absl::Hex(LoadU64(p), absl::kZeroPad16),
                                    " (little-endian), not \"KVMSNAP\": not a kvmesh snapshot"));
    }
    const uint32_t version = LoadU32(p + 8);
    if (version < 1 || version > kSnapshotWireVersion) {
      return Malformed(absl::StrCat("version = ", version,
                                    " is not supported; this node reads versions 1 to ",
                                    kSnapshotWireVersion));
    }
    version_ = version;
    const uint64_t fingerprint = LoadU64(p + 24);
    const uint64_t mine = SpecFingerprint(spec_);
    if (fingerprint != mine) {
      return absl::FailedPreconditionError(
          absl::StrCat(kImage, "spec_fingerprint = 0x", absl::Hex(fingerprint, absl::kZeroPad16),
                       " differs from 0x", absl::Hex(mine, absl::kZeroPad16), " of cache '",
                       spec_.name, "': the snapshot comes from a cache with another spec"));
    }
    const uint64_t total = LoadU64(p + 16);
    if (total != total_) {
      return Malformed(absl::StrCat("total_bytes = ", total, " in the header differs from the ",
                                    total_, " bytes announced for the import"));
    }
    const uint32_t header_bytes = LoadU32(p + 12);
    const size_t min_header = MinSnapshotHeaderBytes(spec_);
    if (header_bytes < min_header || header_bytes > total_) {
      return Malformed(absl::StrCat("header_bytes = ", header_bytes, " is outside [", min_header,
                                    ", total_bytes = ", total_, "]"));
    }
    // Each position costs at most 8 header bytes (its own 4 and, at worst, a 4-byte segment
    // count) and at least one row in the snapshot pool: a header longer than the pool could
    // hold rows for is refused before it is buffered. Version 2's token ids add at most
    // TokenIdLimit ids and their two counts.
    size_t fixed = min_header;
    if (version_ >= 2) fixed += 8 + 4 * static_cast<size_t>(TokenIdLimit(spec_));
    size_t min_row = std::numeric_limits<size_t>::max();
    for (size_t g = 0; g < spec_.groups.size(); ++g) {
      if (spec_.groups[g].kind == GroupKind::kRecurrent) {
        fixed += 4;
      } else {
        min_row = std::min(min_row, Sum(formats_[g].row_bytes));
      }
    }
    const size_t budget =
        formats_.empty() ? 0 : formats_[0].device->budget_bytes(MemoryPool::kSnapshot);
    if (header_bytes > fixed) {
      if (min_row == std::numeric_limits<size_t>::max()) {
        return Malformed(absl::StrCat("header_bytes = ", header_bytes,
                                      " exceeds the largest header of a snapshot of cache '",
                                      spec_.name, "', ", fixed, " bytes"));
      }
      const size_t positions = (header_bytes - fixed + 7) / 8;
      if (min_row > 0 && positions > budget / min_row) {
        // More than the whole pool, whatever is free in it: `free` reports the budget.
        const unsigned __int128 needed = static_cast<unsigned __int128>(positions) * min_row;
        return ResourceExhaustedWith(
            absl::StrCat(kImage, "header_bytes = ", header_bytes, " describes at least ", positions,
                         " rows of at least ", min_row,
                         " bytes, more than the snapshot pool's budget of ", budget,
                         " bytes can hold"),
            {Resource::kSnapshotBytes, -1,
             static_cast<int64_t>(std::min<unsigned __int128>(needed, INT64_MAX)),
             static_cast<int64_t>(budget), static_cast<int64_t>(budget)});
      }
    }
    header_bytes_ = header_bytes;
    return absl::OkStatus();
  }

  absl::Status ReadHeader() {
    ASSIGN_OR_RETURN(SnapshotRecord record, ParseHeader());
    bool placed = false;
    if (place_) {
      ASSIGN_OR_RETURN(placed, place_(&record));
    }
    // Otherwise every group's rows go to one chunk; the segments are runs of it.
    std::vector<std::shared_ptr<RowChunk>> chunks(record.groups.size());
    for (size_t g = 0; g < record.groups.size() && !placed; ++g) {
      int32_t rows = 0;
      for (const Segment& s : record.groups[g].segments) rows += s.rows;
      if (rows == 0) continue;
      const ChunkFormat& f = formats_[g];
      absl::StatusOr<std::shared_ptr<RowChunk>> chunk =
          AllocateChunk(f.device, MemoryPool::kSnapshot, f.stream, f.row_bytes, rows);
      if (!chunk.ok()) {
        return absl::Status(chunk.status().code(),
                            absl::StrCat("importing a snapshot into cache '", spec_.name,
                                         "': group ", g, ": ", chunk.status().message()));
      }
      chunks[g] = *std::move(chunk);
      for (Segment& s : record.groups[g].segments) s.chunk = chunks[g];
    }
    map_ = DataMap(header_bytes_);
    for (size_t g = 0; g < record.groups.size(); ++g) {
      for (const Segment& s : record.groups[g].segments) map_.Add(s, &formats_[g].row_bytes);
    }
    record_ = std::move(record);
    chunks_ = std::move(chunks);
    header_done_ = true;
    staged_begin_ = header_bytes_;
    std::vector<uint8_t>().swap(header_);
    if (written_ == total_) RETURN_IF_ERROR(Flush());
    return absl::OkStatus();
  }

  // Version 2's token ids: token_count ids of positions [0, token_count), at most to and
  // TokenIdLimit; token_taint -1 or within [0, to); every id >= 0.
  absl::Status ParseTokens(Decoder& d, SnapshotRecord* record) const {
    ASSIGN_OR_RETURN(uint32_t count, d.U32("token_count"));
    const uint32_t limit = static_cast<uint32_t>(TokenIdLimit(spec_));
    if (count > static_cast<uint32_t>(record->to) || count > limit || count > d.remaining() / 4) {
      return Malformed(absl::StrCat(
          "token_count = ", count, " is more than ",
          count > static_cast<uint32_t>(record->to)
              ? absl::StrCat("to = ", record->to, ", the end of the snapshot")
          : count > limit ? absl::StrCat("the ", limit, " token ids a sequence of cache '",
                                         spec_.name, "' keeps")
                          : absl::StrCat("the ", d.remaining(), " header bytes left can hold")));
    }
    ASSIGN_OR_RETURN(int32_t taint, d.I32("token_taint"));
    if (taint < -1 || taint >= record->to) {
      return Malformed(absl::StrCat("token_taint = ", taint,
                                    " is neither -1 nor within [0, to = ", record->to, ")"));
    }
    record->tokens.taint = taint == -1 ? kNoTaint : taint;
    record->tokens.ids.resize(count);
    for (uint32_t i = 0; i < count; ++i) {
      ASSIGN_OR_RETURN(int32_t id, d.I32("token_ids"));
      if (id < 0) return Malformed(absl::StrCat("token_ids[", i, "] = ", id, " is negative"));
      record->tokens.ids[i] = id;
    }
    return absl::OkStatus();
  }

  absl::StatusOr<SnapshotRecord> ParseHeader() const {
    Decoder d(header_, kSnapshotWirePreambleBytes);
    SnapshotRecord record;
    ASSIGN_OR_RETURN(record.seq, d.I64("seq"));
    if (record.seq < 0) return Malformed(absl::StrCat("seq = ", record.seq, " is negative"));
    ASSIGN_OR_RETURN(record.from, d.I32("from"));
    ASSIGN_OR_RETURN(record.to, d.I32("to"));
    if (record.from < 0) return Malformed(absl::StrCat("from = ", record.from, " is negative"));
    if (record.to <= record.from) {
      return Malformed(absl::StrCat("to = ", record.to, " is not above from = ", record.from));
    }
    ASSIGN_OR_RETURN(uint32_t num_groups, d.U32("num_groups"));
    if (num_groups != spec_.groups.size()) {
      return Malformed(absl::StrCat("num_groups = ", num_groups, ", but cache '", spec_.name,
                                    "' has ", spec_.groups.size()));
    }
    // Bytes the rows may still take: every segment's rows must fit in the image.
    size_t data_left = total_ - header_bytes_;
    bool too_much_data = false;
    for (size_t g = 0; g < spec_.groups.size(); ++g) {
      const GroupSpec& spec = spec_.groups[g];
      const std::vector<size_t>& row_bytes = formats_[g].row_bytes;
      const std::string prefix = absl::StrCat("groups[", g, "]");
      ASSIGN_OR_RETURN(uint32_t kind, d.U32(prefix + ".kind"));
      if (kind != KindCode(spec.kind)) {
        return Malformed(absl::StrCat(prefix, ".kind = ", kind, ", but group ", g, " of cache '",
                                      spec_.name, "' is ", GroupKindName(spec.kind), " (",
                                      KindCode(spec.kind), ")"));
      }
      GroupSnapshot gs;
      gs.row_bytes = Sum(row_bytes);
      ASSIGN_OR_RETURN(gs.ring_index, d.I32(prefix + ".ring_index"));
      const int32_t ring_index =
          spec.kind == GroupKind::kRotating ? record.to % spec.rotating.max_size : -1;
      if (gs.ring_index != ring_index) {
        return Malformed(
            absl::StrCat(prefix, ".ring_index = ", gs.ring_index, ", expected ", ring_index,
                         spec.kind == GroupKind::kRotating
                             ? absl::StrCat(" (to = ", record.to,
                                            " mod max_size = ", spec.rotating.max_size, ")")
                             : std::string(" (not a Rotating group)")));
      }
      ASSIGN_OR_RETURN(uint32_t has_state, d.U32(prefix + ".has_state"));
      if (has_state > 1 || (has_state == 1 && spec.kind != GroupKind::kRecurrent)) {
        return Malformed(absl::StrCat(prefix, ".has_state = ", has_state, " is not ",
                                      spec.kind == GroupKind::kRecurrent ? "0 or 1" : "0"));
      }
      gs.has_state = has_state == 1;
      ASSIGN_OR_RETURN(uint32_t num_planes, d.U32(prefix + ".num_planes"));
      if (num_planes != row_bytes.size()) {
        return Malformed(
            absl::StrCat(prefix, ".num_planes = ", num_planes, ", expected ", row_bytes.size()));
      }
      for (size_t p = 0; p < row_bytes.size(); ++p) {
        const std::string field = absl::StrCat(prefix, ".row_bytes[", p, "]");
        ASSIGN_OR_RETURN(uint64_t bytes, d.U64(field));
        if (bytes != row_bytes[p]) {
          return Malformed(absl::StrCat(field, " = ", bytes, ", expected ", row_bytes[p]));
        }
      }
      ASSIGN_OR_RETURN(uint32_t num_segments, d.U32(prefix + ".num_segments"));
      const bool recurrent = spec.kind == GroupKind::kRecurrent;
      if (recurrent ? num_segments != (gs.has_state ? 1u : 0u) : num_segments > d.remaining() / 8) {
        return Malformed(absl::StrCat(
            prefix, ".num_segments = ", num_segments,
            recurrent ? absl::StrCat(" with has_state = ", has_state,
                                     "; a recurrent group holds one segment per state")
                      : absl::StrCat(" needs more than the ", d.remaining(),
                                     " header bytes left (header_bytes = ", header_.size(), ")")));
      }
      // Positions allowed: Attention [from, to); Rotating the window ending at `to`.
      const int32_t lowest = spec.kind == GroupKind::kRotating
                                 ? std::max(0, record.to - spec.rotating.max_size)
                                 : record.from;
      int64_t previous = -1;
      int32_t first_row = 0;
      for (uint32_t s = 0; s < num_segments; ++s) {
        const std::string seg = absl::StrCat(prefix, ".segments[", s, "]");
        ASSIGN_OR_RETURN(uint32_t rows, d.U32(seg + ".rows"));
        if (rows == 0 || (recurrent && rows != 1) || (!recurrent && rows > d.remaining() / 4)) {
          return Malformed(absl::StrCat(
              seg, ".rows = ", rows,
              rows == 0 ? " is 0"
              : recurrent
                  ? "; a recurrent state is one row"
                  : absl::StrCat(": its positions need more than the ", d.remaining(),
                                 " header bytes left (header_bytes = ", header_.size(), ")")));
        }
        // Compared with what the image has left, so the sum cannot overflow; a mismatch is
        // reported once the header is known to be well-formed.
        if (gs.row_bytes > 0 && rows > data_left / gs.row_bytes) {
          too_much_data = true;
          data_left = 0;
        } else {
          data_left -= size_t(rows) * gs.row_bytes;
        }
        Segment segment;
        segment.first_row = first_row;
        segment.rows = static_cast<int32_t>(rows);
        if (!recurrent) {
          segment.positions.resize(rows);
          for (uint32_t i = 0; i < rows; ++i) {
            const std::string field = absl::StrCat(seg, ".positions[", i, "]");
            ASSIGN_OR_RETURN(int32_t pos, d.I32(field));
            if (pos <= previous || pos < lowest || pos >= record.to) {
              return Malformed(absl::StrCat(
                  field, " = ", pos,
                  pos <= previous ? absl::StrCat(" is not above the previous position ", previous)
                                  : absl::StrCat(" is outside [", lowest, ", ", record.to, ")",
                                                 spec.kind == GroupKind::kRotating
                                                     ? ", the rotating window that ends at to"
                                                     : ", the snapshot's range [from, to)")));
            }
            segment.positions[i] = pos;
            previous = pos;
          }
        }
        // Positions strictly ascending in [lowest, to) bound the rows to an int32.
        first_row += segment.rows;
        gs.segments.push_back(std::move(segment));
      }
      if (spec.kind == GroupKind::kRotating) {
        // The whole window, never none: a Restore makes the ring hold [lowest, to) and writes
        // the snapshot's rows there, so rows left out would be served with whatever the ring
        // held before (another sequence's data).
        const int32_t stored = gs.stored();
        if (stored != record.to - lowest) {
          return Malformed(absl::StrCat(
              prefix, " holds ", stored, " positions; a rotating window that ends at to = ",
              record.to, " holds positions [", lowest, ", ", record.to, ")"));
        }
      }
      record.groups.push_back(std::move(gs));
    }
    if (version_ >= 2) RETURN_IF_ERROR(ParseTokens(d, &record));
    if (d.offset() != header_.size()) {
      return Malformed(absl::StrCat("header_bytes = ", header_.size(),
                                    ", but the header's fields end at ", d.offset()));
    }
    if (too_much_data || data_left != 0) {
      const size_t data = total_ - header_.size();
      return Malformed(absl::StrCat("total_bytes = ", total_,
                                    " does not match header_bytes = ", header_.size(), " plus ",
                                    too_much_data ? absl::StrCat("more than the ", data)
                                                  : absl::StrCat("the ", data - data_left),
                                    " bytes of the segments' rows"));
    }
    return record;
  }

  // Scatters image bytes [a, b) (row boundaries), read from `src` + (offset - base).
  absl::Status Scatter(size_t a, size_t b, const uint8_t* src, size_t base) {
    Device* device = formats_[0].device;
    return map_.ForEachRun(a, b,
                           [&](const RowChunk& chunk, absl::Span<const Plane> planes,
                               absl::Span<const int32_t> rows, size_t run_at) {
                             return device->Scatter(chunk.arena, planes, rows,
                                                    src + (run_at - base));
                           });
  }

  // Scatters the whole rows staged; keeps a partial row.
  absl::Status Flush() {
    const size_t stop = map_.AlignDown(staged_begin_ + staging_.size());
    if (stop == staged_begin_) return absl::OkStatus();
    RETURN_IF_ERROR(Scatter(staged_begin_, stop, staging_.data(), staged_begin_));
    staging_.erase(staging_.begin(), staging_.begin() + (stop - staged_begin_));
    staged_begin_ = stop;
    return absl::OkStatus();
  }

  const CacheSpec spec_;
  const std::vector<ChunkFormat> formats_;
  const size_t total_;
  const SnapshotCommitFn commit_;
  const SnapshotPlaceFn place_;

  absl::Status error_;
  bool committed_ = false;
  size_t written_ = 0;

  std::vector<uint8_t> header_;  // the header while it arrives
  uint32_t header_bytes_ = 0;    // 0 until the preamble is read
  uint32_t version_ = 0;         // the image's format version, once the preamble is read
  bool header_done_ = false;

  SnapshotRecord record_;  // from the header; its segments point into chunks_
  std::vector<std::shared_ptr<RowChunk>> chunks_;
  DataMap map_;
  std::vector<uint8_t> staging_;  // image bytes [staged_begin_, written_)
  size_t staged_begin_ = 0;
  size_t staging_capacity_ = kSnapshotImportStagingBytes;
};

}  // namespace

uint64_t SpecFingerprint(const CacheSpec& spec) {
  std::vector<uint8_t> e;
  PutU32(&e, DTypeCode(spec.dtype));
  PutI32(&e, spec.max_sequences);
  PutI32(&e, spec.capacity);
  PutI32(&e, spec.max_batch);
  PutU32(&e, static_cast<uint32_t>(spec.groups.size()));
  for (const GroupSpec& g : spec.groups) {
    PutI32(&e, g.num_layers);
    PutU32(&e, KindCode(g.kind));
    switch (g.kind) {
      case GroupKind::kAttention: {
        const AttentionSpec& a = g.attention;
        PutI32(&e, a.num_kv_heads);
        PutI32(&e, a.head_dim_k);
        PutI32(&e, a.head_dim_v);
        PutU32(&e, WindowCode(a.window.kind));
        PutI32(&e, a.window.window);
        PutI32(&e, a.window.memory);
        PutI32(&e, a.window.chunk);
        PutRope(&e, a.rope);
        break;
      }
      case GroupKind::kRotating: {
        const RotatingSpec& r = g.rotating;
        PutI32(&e, r.num_kv_heads);
        PutI32(&e, r.head_dim_k);
        PutI32(&e, r.head_dim_v);
        PutI32(&e, r.max_size);
        PutRope(&e, r.rope);
        break;
      }
      case GroupKind::kRecurrent: {
        const RecurrentSpec& r = g.recurrent;
        PutI32(&e, r.conv_tail);
        PutI32(&e, r.conv_dim);
        PutI32(&e, r.num_v_heads);
        PutI32(&e, r.head_v_dim);
        PutI32(&e, r.head_k_dim);
        break;
      }
    }
  }
  uint64_t hash = 0xcbf29ce484222325ull;  // FNV-1a 64 offset basis
  for (uint8_t byte : e) {
    hash ^= byte;
    hash *= 0x100000001b3ull;  // FNV-1a 64 prime
  }
  return hash;
}

size_t MinSnapshotHeaderBytes(const CacheSpec& spec) {
  size_t bytes = kSnapshotWirePreambleBytes + kSnapshotFixedBytes;
  for (const GroupSpec& g : spec.groups) bytes += GroupFixedBytes(g);
  return bytes;
}

absl::StatusOr<std::unique_ptr<SnapshotExportReader>> NewSnapshotExportReader(
    const CacheSpec& spec, SnapshotRecord record, SnapshotInfo info,
    std::vector<ChunkFormat> formats) {
  auto reader =
      std::make_unique<ExportReader>(std::move(info), std::move(record), std::move(formats));
  RETURN_IF_ERROR(reader->Init(spec));
  return std::unique_ptr<SnapshotExportReader>(std::move(reader));
}

std::unique_ptr<SnapshotImportWriter> NewSnapshotImportWriter(const CacheSpec& spec,
                                                              std::vector<ChunkFormat> formats,
                                                              size_t total_bytes,
                                                              SnapshotCommitFn commit,
                                                              SnapshotPlaceFn place) {
  return std::make_unique<ImportWriter>(spec, std::move(formats), total_bytes, std::move(commit),
                                        std::move(place));
}

}  // namespace kvmesh
