// The wire image of a snapshot: the byte string in which a snapshot moves between nodes
// (docs/cluster.md "The unit of transfer"), and the reader and writer behind
// Cache::OpenSnapshotExport and Cache::BeginSnapshotImport.
//
// Format, version 2 (version 1 is version 2 without the token section; a writer uses it when the
// snapshot has no token ids, and a reader takes both). Every integer is little-endian with the size
// given; offsets are from the start of the image. The header is self-describing and its size is
// known after the preamble, so a receiver buffers exactly the header and streams the data rows to
// the device.
//
//   preamble (32 bytes)
//     0   magic            8 bytes  "KVMSNAP\0"
//     8   version          u32      1 or 2
//     12  header_bytes     u32      bytes of the whole header, preamble included: the data
//                                   rows start here
//     16  total_bytes      u64      bytes of the whole image
//     24  spec_fingerprint u64      SpecFingerprint of the exporting cache's spec
//   snapshot
//     32  seq              i64      the sequence the snapshot was taken from (>= 0)
//     40  from             i32      the snapshot covers [from, to), 0 <= from < to
//     44  to               i32
//     48  num_groups       u32      == the spec's number of groups
//   then for each group g in spec order ("groups[g]" in error messages):
//         kind             u32      0 Attention, 1 Rotating, 2 Recurrent; == the spec's
//         ring_index       i32      Rotating: to mod max_size; otherwise -1
//         has_state        u32      Recurrent: 1 when the group holds a state, else 0;
//                                   otherwise 0
//         num_planes       u32      planes of the group's chunks (2 x num_layers for
//                                   Attention and Rotating: K0, V0, K1, V1, ...; num_layers for
//                                   Recurrent)
//         row_bytes        u64 x num_planes  bytes of one row of each plane; == the spec's
//         num_segments     u32
//         for each segment s ("groups[g].segments[s]"):
//           rows           u32      >= 1
//           positions      i32 x rows  Attention and Rotating only (none for Recurrent): the
//                                   position of each row
//   then, in version 2 only, the token ids (cache/token_chain.h) of the sequence it was taken
//   from:
//         token_count      u32      ids of positions [0, token_count): <= to, and <= the
//                                   TokenIdLimit of the spec
//         token_taint      i32      -1 (none), or the taint, within [0, to)
//         token_ids        i32 x token_count  each >= 0
//   header_bytes must equal the end of the last field.
//   data, from header_bytes to total_bytes: for each group in spec order, for each segment in
//   order, for each plane in order, the segment's rows: rows x row_bytes[plane] bytes. A row
//   of an Attention or Rotating plane is one token's K (or V) of one layer, [heads][head_dim]
//   in dtype; a row of a Recurrent plane is one layer's state, conv [conv_tail][conv_dim] in
//   dtype then delta [num_v_heads][head_v_dim][head_k_dim] in float32. Elements are stored as
//   in Append and Read payloads (little-endian). total_bytes == header_bytes + the sum of the
//   rows' bytes.
//
// What an importer checks, in this order (INVALID_ARGUMENT naming the field, unless said
// otherwise), as soon as the preamble has arrived: magic; version; spec_fingerprint equal to
// the cache's (FAILED_PRECONDITION); total_bytes equal to the size the import announced;
// header_bytes within [the smallest header of the spec, total_bytes], and no larger than a
// header whose positions the snapshot pool could hold rows for (RESOURCE_EXHAUSTED beyond: every
// position costs at most 8 header bytes and at least one row; version 2 adds the largest token
// section), so that no more than that is ever buffered. Once the whole header has arrived: seq >=
// 0; 0 <= from < to; num_groups and each kind equal to the spec's; ring_index and has_state as
// above; num_planes and row_bytes equal to the cache's chunk format; every count fits in what is
// left of the header before anything is read or allocated for it; Attention positions strictly
// ascending across the group's segments and within [from, to); Rotating positions strictly
// ascending and exactly the window [max(0, to - max_size), to) (never none: a Restore serves the
// whole window, so every row of it must come with the image); Recurrent one segment of one row when
// has_state, none otherwise; the fields end exactly at header_bytes; the rows' bytes add up to
// total_bytes - header_bytes. Positions are bounded by the snapshot's range and the image's
// size, not by capacity: a sequence may hold more positions than capacity (the cell pool is
// shared; docs/semantics.md, "Decisions where the contract is silent"), and so may a merged
// snapshot. Only then is the snapshot pool charged (one chunk per group; RESOURCE_EXHAUSTED
// when it is full).
//
// The image carries no checksum: the transport computes and verifies one over the whole image
// (docs/cluster.md).
//
// The spec fingerprint is FNV-1a (64 bit) over a canonical encoding of every CacheSpec field
// except `name`: dtype, max_sequences, capacity, max_batch, and per group num_layers, kind and
// that kind's fields, each as a little-endian 32-bit value (enums by fixed codes, floats by
// their IEEE-754 bits), with the rope's dims/base/freq_scale encoded as 0 when its type is NONE
// (as CacheSpec::operator== ignores them). Two specs have equal fingerprints iff they are equal
// apart from the name (up to hash collisions). The name is left out on purpose: it names a
// cache on a node, while the fingerprint vouches for the meaning and layout of the rows; the
// cluster's Export compares whole specs, names included, before any image moves.
//
// Thread safety: free functions are thread-safe. A reader or writer is used by one thread at a
// time (SnapshotExportReader, SnapshotImportWriter in cache/types.h).
#ifndef KVMESH_CACHE_SNAPSHOT_WIRE_H_
#define KVMESH_CACHE_SNAPSHOT_WIRE_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "cache/layer_group.h"
#include "cache/spec.h"
#include "cache/types.h"

namespace kvmesh {

inline constexpr char kSnapshotWireMagic[8] = {'K', 'V', 'M', 'S', 'N', 'A', 'P', '\0'};
inline constexpr uint32_t kSnapshotWireVersion = 2;
inline constexpr size_t kSnapshotWirePreambleBytes = 32;

// The import writer gathers small writes into a host buffer of this size (or of the largest
// plane row, when larger) before scattering them to the device; a write that brings at least
// this much goes to the device directly.
inline constexpr size_t kSnapshotImportStagingBytes = size_t{256} << 10;

// FNV-1a over the canonical encoding of `spec` without its name (see above).
uint64_t SpecFingerprint(const CacheSpec& spec);

// Bytes of the smallest header a cache of `spec` can have (every group without segments).
size_t MinSnapshotHeaderBytes(const CacheSpec& spec);

// A reader of `record`'s wire image. `info` is what SnapshotExportReader::info returns;
// `formats` are the chunk formats of the cache's groups (one per group). The reader keeps
// `record`, and with it references to its chunks. INTERNAL when a chunk does not have its group's
// format.
absl::StatusOr<std::unique_ptr<SnapshotExportReader>> NewSnapshotExportReader(
    const CacheSpec& spec, SnapshotRecord record, SnapshotInfo info,
    std::vector<ChunkFormat> formats);

// Called by Commit with the complete snapshot; stores it and returns its info.
using SnapshotCommitFn = std::function<SnapshotInfo(SnapshotRecord record)>;

// Says where an import's rows go, once its header is checked and before any data row arrives:
// given the record the header describes (segments without chunks), it either sets every
// segment's chunk and rows (Segment::chunk_rows) and returns true, or leaves the record alone
// and returns false, and the writer allocates snapshot-pool chunks as it does without one. An
// error fails the import.
using SnapshotPlaceFn = std::function<absl::StatusOr<bool>(SnapshotRecord* record)>;

// A writer of an image of `total_bytes` for a cache of `spec` whose groups have `formats`.
// REQUIRES: total_bytes >= MinSnapshotHeaderBytes(spec).
std::unique_ptr<SnapshotImportWriter> NewSnapshotImportWriter(const CacheSpec& spec,
                                                              std::vector<ChunkFormat> formats,
                                                              size_t total_bytes,
                                                              SnapshotCommitFn commit,
                                                              SnapshotPlaceFn place = nullptr);

}  // namespace kvmesh

#endif  // KVMESH_CACHE_SNAPSHOT_WIRE_H_
