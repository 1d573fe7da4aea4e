// Fuzz target: the snapshot wire image as a receiving node imports it (cache/snapshot_wire.h).
//
// The bytes of an image arrive from a peer (Cluster::PullInto: BeginSnapshotImport with the size
// the sender announced, Write of each chunk the transport delivers, Commit, then a Restore into
// the destination sequence and, for a sequence, DropSnapshot). This target does exactly that on a
// real Cache on the host device, with the image and its cutting into writes taken from the input
// (format: fuzz_support.h, WireFlags), and checks:
//  - a refused image fails with INVALID_ARGUMENT, FAILED_PRECONDITION or RESOURCE_EXHAUSTED and
//    a message, every later call on the writer repeats the error, and the cache is as it was
//    (CacheDigest) with every snapshot-pool byte the import took given back;
//  - an accepted image is a snapshot whose info describes it and whose export is the very same
//    bytes; restoring it into an empty sequence stores exactly the image's positions and rows
//    (an independent reading of the format below), or fails cleanly, leaving the cache as it
//    was; dropping it and the cache frees every device byte.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "cache/cache.h"
#include "cache/device/host_device.h"
#include "cache/snapshot_wire.h"
#include "cache/spec.h"
#include "tests/fuzz/fuzz_support.h"

namespace kvmesh {
namespace fuzz {
namespace {

uint32_t Load32(const uint8_t* p) {
  return uint32_t{p[0]} | uint32_t{p[1]} << 8 | uint32_t{p[2]} << 16 | uint32_t{p[3]} << 24;
}
uint64_t Load64(const uint8_t* p) { return Load32(p) | uint64_t{Load32(p + 4)} << 32; }
void Store32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
void Store64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}

// An accepted image read again, independently of cache/snapshot_wire.cc, from the format in
// snapshot_wire.h: per group its positions (Attention, Rotating) or state, and where each
// plane's row of each of them lies in the image.
struct ParsedGroup {
  std::vector<int32_t> positions;
  bool has_state = false;
  int32_t ring_index = -1;
  // rows[plane][i]: image offset of row i (position i, or the state) of that plane.
  std::vector<std::vector<size_t>> rows;
  std::vector<size_t> row_bytes;
};
struct ParsedImage {
  int64_t seq = 0;
  int32_t from = 0;
  int32_t to = 0;
  std::vector<ParsedGroup> groups;
};

// REQUIRES: the importer accepted `image` (so it is well-formed); a failure here means the
// importer accepted something the format does not allow.
ParsedImage Parse(const CacheSpec& spec, absl::Span<const uint8_t> image) {
  ParsedImage out;
  size_t at = 32;
  auto need = [&](size_t n) {
    KVMESH_FUZZ_CHECK(at + n <= image.size(),
                      absl::StrCat("accepted image ends at ", image.size(), " inside its header"));
  };
  auto u32 = [&] {
    need(4);
    const uint32_t v = Load32(image.data() + at);
    at += 4;
    return v;
  };
  auto u64 = [&] {
    need(8);
    const uint64_t v = Load64(image.data() + at);
    at += 8;
    return v;
  };
  const size_t header_bytes = Load32(image.data() + 12);
  out.seq = static_cast<int64_t>(u64());
  out.from = static_cast<int32_t>(u32());
  out.to = static_cast<int32_t>(u32());
  const uint32_t groups = u32();
  KVMESH_FUZZ_CHECK(groups == spec.groups.size(), groups);
  struct Pending {
    size_t group;
    std::vector<uint32_t> segment_rows;
  };
  std::vector<Pending> layout;
  for (size_t g = 0; g < groups; ++g) {
    ParsedGroup pg;
    (void)u32();  // kind
    pg.ring_index = static_cast<int32_t>(u32());
    pg.has_state = u32() == 1;
    const uint32_t planes = u32();
    for (uint32_t p = 0; p < planes; ++p) pg.row_bytes.push_back(u64());
    pg.rows.resize(planes);
    Pending pending{g, {}};
    const uint32_t segments = u32();
    for (uint32_t s = 0; s < segments; ++s) {
      const uint32_t rows = u32();
      pending.segment_rows.push_back(rows);
      if (spec.groups[g].kind != GroupKind::kRecurrent) {
        for (uint32_t i = 0; i < rows; ++i) pg.positions.push_back(static_cast<int32_t>(u32()));
      }
    }
    out.groups.push_back(std::move(pg));
    layout.push_back(std::move(pending));
  }
  KVMESH_FUZZ_CHECK(at == header_bytes,
                    absl::StrCat("fields end at ", at, ", header_bytes = ", header_bytes));
  // Data: for each group, for each segment, for each plane, the segment's rows.
  for (const Pending& pending : layout) {
    ParsedGroup& pg = out.groups[pending.group];
    for (uint32_t rows : pending.segment_rows) {
      for (size_t p = 0; p < pg.row_bytes.size(); ++p) {
        for (uint32_t r = 0; r < rows; ++r) {
          pg.rows[p].push_back(at);
          at += pg.row_bytes[p];
        }
      }
    }
  }
  KVMESH_FUZZ_CHECK(at == image.size(), absl::StrCat("rows end at ", at, " of an accepted ",
                                                     image.size(), "-byte image"));
  return out;
}

// The error of a refused import: one of the codes an importer may answer, with a message.
void CheckRefusal(const absl::Status& status, absl::string_view step) {
  KVMESH_FUZZ_CHECK(status.code() == absl::StatusCode::kInvalidArgument ||
                        status.code() == absl::StatusCode::kFailedPrecondition ||
                        status.code() == absl::StatusCode::kResourceExhausted,
                    absl::StrCat(step, ": ", status.ToString()));
  KVMESH_FUZZ_CHECK(!status.message().empty(), step);
}

// The sizes of the writes: what a transport's chunks may be, from one byte to the whole image.
class WriteSizes {
 public:
  explicit WriteSizes(uint8_t seed) : state_(seed * 2654435761u + 1) {}
  size_t Next() {
    state_ = state_ * 1103515245u + 12345u;
    static constexpr size_t kLimits[] = {1, 3, 8, 33, 256, 4096, size_t{1} << 30};
    const size_t limit = kLimits[(state_ >> 16) % 7];
    return 1 + (state_ >> 8) % limit;
  }

 private:
  uint32_t state_;
};

// The expected Read of a sequence holding exactly the image's data of group g (positions below
// `target`, every plane), in the Read payload layout: per layer K rows then V rows; per layer the
// state.
std::string ExpectedGroupPayload(const CacheSpec& spec, size_t g, const ParsedGroup& pg,
                                 absl::Span<const uint8_t> image, int32_t target) {
  std::string out;
  if (spec.groups[g].kind == GroupKind::kRecurrent) {
    if (!pg.has_state) return out;
    for (size_t p = 0; p < pg.rows.size(); ++p) {
      out.append(reinterpret_cast<const char*>(image.data() + pg.rows[p][0]), pg.row_bytes[p]);
    }
    return out;
  }
  for (size_t p = 0; p < pg.rows.size(); ++p) {
    for (size_t i = 0; i < pg.positions.size(); ++i) {
      if (pg.positions[i] >= target) break;
      out.append(reinterpret_cast<const char*>(image.data() + pg.rows[p][i]), pg.row_bytes[p]);
    }
  }
  return out;
}

void CheckAccepted(Cache& cache, const SnapshotInfo& info, absl::Span<const uint8_t> image,
                   uint8_t flags) {
  const CacheSpec& spec = cache.spec();
  const ParsedImage parsed = Parse(spec, image);
  // The info describes the image.
  KVMESH_FUZZ_CHECK(info.id > 0, info.id);
  KVMESH_FUZZ_CHECK(info.seq == parsed.seq && info.from == parsed.from && info.to == parsed.to,
                    absl::StrCat("info ", info.seq, " [", info.from, ", ", info.to, "), image ",
                                 parsed.seq, " [", parsed.from, ", ", parsed.to, ")"));
  KVMESH_FUZZ_CHECK(info.groups.size() == spec.groups.size(), info.groups.size());
  size_t data_bytes = 0;
  for (size_t g = 0; g < spec.groups.size(); ++g) {
    const ParsedGroup& pg = parsed.groups[g];
    const SnapshotGroupInfo& gi = info.groups[g];
    for (size_t p = 0; p < pg.rows.size(); ++p) data_bytes += pg.rows[p].size() * pg.row_bytes[p];
    if (spec.groups[g].kind == GroupKind::kRecurrent) {
      KVMESH_FUZZ_CHECK(gi.state == (pg.has_state ? StateStatus::kValid : StateStatus::kNone),
                        absl::StrCat("group ", g, " state ", StateStatusName(gi.state)));
    } else {
      KVMESH_FUZZ_CHECK(
          gi.stored == static_cast<int32_t>(pg.positions.size()),
          absl::StrCat("group ", g, " stored ", gi.stored, ", image ", pg.positions.size()));
    }
    KVMESH_FUZZ_CHECK(gi.ring_index == pg.ring_index, absl::StrCat("group ", g));
  }
  KVMESH_FUZZ_CHECK(info.bytes == data_bytes,
                    absl::StrCat("info.bytes ", info.bytes, ", image rows ", data_bytes));
  bool listed = false;
  for (const SnapshotInfo& s : cache.ListSnapshots()) listed |= s.id == info.id;
  KVMESH_FUZZ_CHECK(listed, info.id);

  // Exported again, it is the same bytes: the format is canonical, so an image the importer
  // accepts travels on unchanged (a MigrateSnapshot onwards).
  {
    absl::StatusOr<std::unique_ptr<SnapshotExportReader>> reader =
        cache.OpenSnapshotExport(info.id);
    KVMESH_FUZZ_CHECK(reader.ok(), reader.status().ToString());
    KVMESH_FUZZ_CHECK((*reader)->size() == image.size(),
                      absl::StrCat((*reader)->size(), " vs ", image.size()));
    std::vector<uint8_t> again(image.size());
    // In two reads cut inside the data, to go through both of the reader's paths.
    const size_t cut = image.size() / 2 + 1;
    absl::Status read = (*reader)->ReadAt(0, absl::MakeSpan(again).subspan(0, cut));
    if (read.ok()) read = (*reader)->ReadAt(cut, absl::MakeSpan(again).subspan(cut));
    KVMESH_FUZZ_CHECK(read.ok(), read.ToString());
    KVMESH_FUZZ_CHECK(std::memcmp(again.data(), image.data(), image.size()) == 0,
                      "the export of an imported snapshot differs from the image");
  }

  // What PullInto's caller does next: restore it into the destination sequence.
  const int64_t dst = (flags & kRestoreIntoPrefilled) ? 0 : 1;
  const std::string before_restore = CacheDigest(cache);
  const absl::Status restored = cache.Restore(dst, info.id, info.to);
  if (!restored.ok()) {
    KVMESH_FUZZ_CHECK(restored.code() == absl::StatusCode::kFailedPrecondition ||
                          restored.code() == absl::StatusCode::kResourceExhausted,
                      restored.ToString());
    KVMESH_FUZZ_CHECK(
        CacheDigest(cache) == before_restore,
        absl::StrCat("a refused Restore (", restored.ToString(), ") changed the cache"));
  } else if (dst == 1) {
    // Sequence 1 was empty: it now holds the image's data and nothing else.
    absl::StatusOr<ReadResult> read = cache.Read(1, 0, std::nullopt);
    bool empty = true;
    for (const ParsedGroup& pg : parsed.groups) empty &= pg.positions.empty() && !pg.has_state;
    if (!read.ok()) {
      KVMESH_FUZZ_CHECK(read.status().code() == absl::StatusCode::kNotFound && empty,
                        read.status().ToString());
    } else {
      std::string expected;
      for (size_t g = 0; g < spec.groups.size(); ++g) {
        const ParsedGroup& pg = parsed.groups[g];
        if (spec.groups[g].kind != GroupKind::kRecurrent) {
          KVMESH_FUZZ_CHECK(read->positions[g] == pg.positions,
                            absl::StrCat("group ", g, ": the restored sequence holds ",
                                         read->positions[g].size(), " positions (first ",
                                         read->positions[g].empty() ? -1 : read->positions[g][0],
                                         "), the image ", pg.positions.size()));
        } else if (read->states[g] != StateStatus::kValid) {
          // The state belongs to offset `to`: a Read returns it only when the sequence's offset
          // is `to` too, which positions below to - 1 in other groups do not change.
          continue;
        }
        expected += ExpectedGroupPayload(spec, g, pg, image, info.to);
      }
      if (read->payload.size() == expected.size()) {
        KVMESH_FUZZ_CHECK(read->payload == expected,
                          "the restored sequence's bytes differ from the image's rows");
      } else {
        // Only a Recurrent state the Read left out (see above) may make them differ in size.
        bool skipped_state = false;
        for (size_t g = 0; g < spec.groups.size(); ++g) {
          skipped_state |= spec.groups[g].kind == GroupKind::kRecurrent &&
                           read->states[g] != StateStatus::kValid && parsed.groups[g].has_state;
        }
        KVMESH_FUZZ_CHECK(skipped_state, absl::StrCat("Read payload ", read->payload.size(),
                                                      " bytes, image rows ", expected.size()));
      }
    }
  }
  // The pulled snapshot is dropped (CommitSequence); the destination keeps its data.
  const absl::Status dropped = cache.DropSnapshot(info.id);
  KVMESH_FUZZ_CHECK(dropped.ok(), dropped.ToString());
  for (const SnapshotInfo& s : cache.ListSnapshots()) KVMESH_FUZZ_CHECK(s.id != info.id, s.id);
}

HostDevice& DeviceOf(size_t index) {
  static std::vector<std::unique_ptr<HostDevice>>* const devices = [] {
    auto* v = new std::vector<std::unique_ptr<HostDevice>>;
    for (const WireCase& c : WireCases()) {
      v->push_back(std::make_unique<HostDevice>(c.cache_budget, c.snapshot_budget));
    }
    return v;
  }();
  return *(*devices)[index];
}

// Imports `image` into `cache` as a receiving node does (Cluster::PullInto) and checks the
// outcome.
void Import(Cache& cache, HostDevice& device, std::vector<uint8_t> image, size_t announced,
            uint8_t flags, WriteSizes sizes) {
  const CacheSpec& spec = cache.spec();
  const std::string before = CacheDigest(cache);
  const size_t pool_before = device.used_bytes(MemoryPool::kSnapshot);
  // Everything a failed import must leave as it was.
  auto check_untouched = [&](absl::string_view what) {
    KVMESH_FUZZ_CHECK(CacheDigest(cache) == before, absl::StrCat(what, " changed the cache"));
    KVMESH_FUZZ_CHECK(device.used_bytes(MemoryPool::kSnapshot) == pool_before,
                      absl::StrCat(what, " kept ", device.used_bytes(MemoryPool::kSnapshot),
                                   " snapshot pool bytes, not ", pool_before));
  };

  absl::StatusOr<std::unique_ptr<SnapshotImportWriter>> writer =
      cache.BeginSnapshotImport(announced);
  if (!writer.ok()) {
    CheckRefusal(writer.status(), "BeginSnapshotImport");
    KVMESH_FUZZ_CHECK(announced < MinSnapshotHeaderBytes(spec), writer.status().ToString());
    check_untouched("a refused BeginSnapshotImport");
    return;
  }
  absl::Status status;
  size_t at = 0;
  while (at < image.size()) {
    const size_t n = std::min(sizes.Next(), image.size() - at);
    status = (*writer)->Write(absl::MakeConstSpan(image).subspan(at, n));
    if (!status.ok()) break;
    at += n;
    KVMESH_FUZZ_CHECK((*writer)->written() == at,
                      absl::StrCat((*writer)->written(), " written, ", at, " given"));
  }
  if (!status.ok()) {
    CheckRefusal(status, "Write");
    // Any error is final.
    const uint8_t more = 0;
    KVMESH_FUZZ_CHECK((*writer)->Write({&more, 1}) == status, "a Write after an error");
    KVMESH_FUZZ_CHECK((*writer)->Commit().status() == status, "Commit after an error");
    writer->reset();
    check_untouched("a refused image");
    return;
  }
  if (flags & kDropWithoutCommit) {
    writer->reset();
    check_untouched("an import dropped before Commit");
    return;
  }
  absl::StatusOr<SnapshotInfo> committed = (*writer)->Commit();
  if (flags & kShortDelivery) {
    KVMESH_FUZZ_CHECK(!committed.ok(), "Commit of a short image succeeded");
  }
  if (!committed.ok()) {
    CheckRefusal(committed.status(), "Commit");
    KVMESH_FUZZ_CHECK((*writer)->Commit().status() == committed.status(), "Commit after an error");
    writer->reset();
    check_untouched("a refused Commit");
    return;
  }
  const absl::Status again = (*writer)->Commit().status();
  KVMESH_FUZZ_CHECK(again.code() == absl::StatusCode::kFailedPrecondition, again.ToString());
  writer->reset();
  CheckAccepted(cache, *committed, image, flags);
}

void Run(const uint8_t* data, size_t size) {
  if (size < kWireInputHeader) return;
  const std::vector<WireCase>& cases = WireCases();
  const size_t index = data[0] % cases.size();
  const CacheSpec& spec = cases[index].spec;
  HostDevice& device = DeviceOf(index);
  const uint8_t flags = data[1];
  std::vector<uint8_t> image(data + kWireInputHeader, data + size);
  size_t announced = image.size();
  if (flags & kShortDelivery) announced += 1 + data[2] % 7;
  if ((flags & kFixPreamble) && image.size() >= kSnapshotWirePreambleBytes) {
    std::memcpy(image.data(), kSnapshotWireMagic, sizeof(kSnapshotWireMagic));
    Store32(image.data() + 8, kSnapshotWireVersion);
    Store64(image.data() + 16, announced);
    Store64(image.data() + 24, SpecFingerprint(spec));
  }
  {
    absl::StatusOr<std::unique_ptr<Cache>> cache = Cache::Create(spec, &device);
    KVMESH_FUZZ_CHECK(cache.ok(), cache.status().ToString());
    const absl::Status prefilled = Prefill(**cache);
    KVMESH_FUZZ_CHECK(prefilled.ok(), prefilled.ToString());
    Import(**cache, device, std::move(image), announced, flags, WriteSizes(data[2]));
  }
  // Whatever happened, a deleted cache gives every device byte back.
  KVMESH_FUZZ_CHECK(
      device.used_bytes(MemoryPool::kCache) == 0 && device.used_bytes(MemoryPool::kSnapshot) == 0,
      absl::StrCat("a deleted cache left ", device.used_bytes(MemoryPool::kCache), " + ",
                   device.used_bytes(MemoryPool::kSnapshot), " device bytes"));
}

}  // namespace
}  // namespace fuzz
}  // namespace kvmesh

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kvmesh::fuzz::Run(data, size);
  return 0;
}
