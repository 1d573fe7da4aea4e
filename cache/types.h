// The engine's vocabulary: the value types that the Cache's operations take and return, and the
// interfaces through which a snapshot's wire image leaves and enters a cache. The layer groups,
// the snapshot wire format and the registry use these without the Cache (cache/cache.h), which
// is built on them; nothing under cache/ but the Cache's own files includes cache/cache.h
// (tests/layering_test.sh).
//
// Thread safety: plain values; the interfaces say their own.
#ifndef KVMESH_CACHE_TYPES_H_
#define KVMESH_CACHE_TYPES_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "cache/token_chain.h"

namespace kvmesh {

// One token of an Append batch.
struct Token {
  int64_t seq = 0;
  int32_t pos = 0;
  int32_t id = kNoTokenId;  // the token id at this position (>= 0), when the caller gives it
};

// One row of a Visible request: which stored positions a query at `pos` attends to.
struct Query {
  int64_t seq = 0;
  int32_t pos = 0;
  bool non_causal = false;  // when set, positions after `pos` are visible too
};

// Consecutive positions first, first + 1, ..., last (both included, so that a range may end at
// INT32_MAX). A Visible answer in ranges lists maximal ones, ascending.
struct PositionRange {
  int32_t first = 0;
  int32_t last = 0;
  bool operator==(const PositionRange& other) const {
    return first == other.first && last == other.last;
  }
};

// Recurrent state of a sequence in a Recurrent group. kNone: the group is not Recurrent, the
// sequence has no state there, or (in a Read) the range stops before the state's offset.
enum class StateStatus { kNone, kValid, kInvalid };

const char* StateStatusName(StateStatus status);

struct ReadResult {
  // positions[g]: stored positions of group g returned, ascending (empty for Recurrent groups).
  std::vector<std::vector<int32_t>> positions;
  // states[g]: for a Recurrent group, kValid when the payload holds the sequence's state (the
  // range reaches the sequence's offset and the state is valid), kInvalid when the state was
  // invalidated (the payload holds none); kNone otherwise.
  std::vector<StateStatus> states;
  // For each group in spec order, for each layer: Attention/Rotating K [T_g][heads][head_dim_k]
  // then V [T_g][heads][head_dim_v]; Recurrent conv [conv_tail][conv_dim] in dtype then delta
  // [num_v_heads][head_v_dim][head_k_dim] in float32 when states[g] == kValid
  // (docs/api.md#payload-layout).
  std::string payload;
};

struct GroupSequenceInfo {
  int32_t stored = 0;  // positions stored in this group (Recurrent: 0)
  int32_t shared = 0;  // of those, cells also referenced by another sequence (Recurrent: 1 when
                       // the state slot is shared copy-on-write)
  int32_t first = -1;  // lowest stored position, -1 when none
  int32_t last = -1;   // highest stored position, -1 when none
  StateStatus state = StateStatus::kNone;  // Recurrent groups only
};

struct SequenceInfo {
  int64_t seq = 0;
  int32_t offset = 0;   // one past the largest position over all groups (pending included)
  int32_t pending = 0;  // speculative tokens not yet committed
  std::vector<GroupSequenceInfo> groups;
  // Token ids (cache/token_chain.h): known for positions [0, tokens); of those, the first
  // exact_tokens hold K/V computed from those tokens alone; hashed blocks of them.
  int32_t tokens = 0;
  int32_t exact_tokens = 0;
  int32_t token_blocks = 0;
  // Retention (Cache::SetRetention) and the last use of the sequence.
  int32_t priority = 0;
  bool pinned = false;
  absl::Duration ttl = absl::ZeroDuration();
  absl::Time last_used = absl::InfinitePast();
};

// How long a sequence is kept (Cache::SetRetention, docs/api.md#eviction).
struct Retention {
  // Under EvictionPolicy::kLru, lower priorities are evicted first; among equal ones the least
  // recently used sequence goes first.
  int32_t priority = 0;
  // Never evicted to make room. A TTL still applies: it is the caller's own request.
  bool pinned = false;
  // > 0: the sequence is removed once unused for that long (Cache::ExpireIdle).
  absl::Duration ttl = absl::ZeroDuration();
};

// How Cache::Restore and Cache::RestoreImport treat what the sequence holds beyond the data.
struct RestoreOptions {
  // An incremental pull (docs/api.md#copyprefix): a snapshot starting at from > 0 replaces only
  // the sequence's positions from there on, and is refused (FAILED_PRECONDITION, nothing
  // changed) unless its token chain holds, exactly, the snapshot's token ids of positions
  // [0, from): what it keeps must be what the snapshot's sequence held there.
  bool keeps_prefix = false;
  // Set: the sequence's retention once restored, in the same step (a migrated sequence takes
  // its source's), so that no eviction or expiry sees it in between; INVALID_ARGUMENT for a
  // negative ttl. Unset: it keeps its own (the default for a sequence that stored nothing).
  std::optional<Retention> retention;
};

// A sequence that holds a prefix of a prompt (Cache::LookupPrefix).
struct PrefixMatch {
  int64_t seq = 0;
  int32_t length = 0;       // the prompt's first `length` tokens, compared id by id
  int32_t offset = 0;       // the sequence's offset
  bool can_resume = false;  // CanResume(seq, length): every group can continue there
};

// The block hashes of a sequence (Cache::ListChains).
struct SequenceBlocks {
  int64_t seq = 0;
  int32_t offset = 0;
  std::vector<uint64_t> hashes;
};
struct ChainListing {
  uint64_t last_event = 0;
  std::vector<SequenceBlocks> sequences;
};

// What a cache's block index holds (Cache::TokenIndexStats).
struct TokenIndexStats {
  size_t sequences = 0;  // sequences with a token chain
  size_t hashes = 0;     // distinct block hashes
  size_t entries = 0;    // (hash, sequence) pairs
  size_t bytes = 0;      // host bytes of the index, roughly
};

struct GroupUsage {
  // Attention: cells. Rotating: ring rows (rings x max_size). Recurrent: state slots.
  int64_t cells_total = 0;
  int64_t cells_used = 0;  // referenced by at least one sequence
  int32_t memory = 0;      // effective per-sequence memory, kUnlimitedMemory when unlimited
  size_t bytes = 0;        // device bytes of the group's arena
  // Of the free ones, cells held back for room reservations (Cache::Reserve; Attention only).
  int64_t cells_reserved = 0;
};

struct CacheUsage {
  std::vector<GroupUsage> groups;
  int32_t sequences_live = 0;
  // Sequences that store nothing yet but hold a room reservation (a sequence slot each).
  int32_t sequences_reserved = 0;
  size_t bytes_held = 0;  // group arenas and pending speculative data
  int32_t snapshots = 0;
  size_t snapshot_bytes = 0;  // snapshot pool bytes held by this cache's snapshots
  // Bytes pinned by open export readers (exports to other nodes under a lease): snapshot pool
  // bytes, whether or not their snapshot still exists, or the bytes of a sequence's cells that
  // an export reads straight from them (Cache::OpenSequenceExport).
  size_t export_bytes = 0;
};

struct SnapshotGroupInfo {
  int32_t stored = 0;                      // Attention/Rotating: positions held
  int32_t ring_index = -1;                 // Rotating: the ring's write index (to mod max_size)
  StateStatus state = StateStatus::kNone;  // Recurrent: kValid
};

struct SnapshotInfo {
  uint64_t id = 0;   // > 0, unique within the cache
  int64_t seq = 0;   // the sequence it was taken from (the child's, after a merge)
  int32_t from = 0;  // the snapshot covers [from, to)
  int32_t to = 0;
  size_t bytes = 0;  // data bytes it references in the snapshot pool
  std::vector<SnapshotGroupInfo> groups;
  int32_t tokens = 0;  // token ids it keeps, of positions [0, tokens)
};

// The wire image of one snapshot (Cache::OpenSnapshotExport).
class SnapshotExportReader {
 public:
  virtual ~SnapshotExportReader() = default;
  // Bytes of the whole wire image.
  virtual size_t size() const = 0;
  // What the image holds, as SnapshotInfo of the exporting cache (its id there).
  virtual const SnapshotInfo& info() const = 0;
  // Copies bytes [offset, offset + dst.size()) of the image into dst (host memory).
  // OUT_OF_RANGE past size(); device errors as Device::Gather.
  virtual absl::Status ReadAt(size_t offset, absl::Span<uint8_t> dst) = 0;
  // The image's bytes from `offset` on where they lie in host memory, without a copy: the
  // longest contiguous run there, at most `max_bytes` (a run ends at the end of the header or
  // of one plane of one segment). Empty when offset >= size(), max_bytes == 0, or the bytes are
  // not in host memory (a device other than HostDevice): use ReadAt then. The bytes stay valid
  // and unchanged while the reader exists. Thread-safe, also against ReadAt.
  virtual absl::Span<const uint8_t> View(size_t offset, size_t max_bytes) const {
    (void)offset;
    (void)max_bytes;
    return {};
  }
};

// Receives a wire image (Cache::BeginSnapshotImport). Write appends the next bytes; the header
// is checked as soon as it is complete (INVALID_ARGUMENT for a malformed one naming the field,
// FAILED_PRECONDITION when its spec fingerprint differs from the cache's), and the snapshot pool
// is charged for the data then (RESOURCE_EXHAUSTED). Any error is final: later calls return it.
// Destroying a writer without Commit frees everything it held; the cache never sees a partial
// snapshot. One thread at a time; the cache must outlive the writer.
class SnapshotImportWriter {
 public:
  virtual ~SnapshotImportWriter() = default;
  // Appends `bytes` (host memory). INVALID_ARGUMENT beyond total_bytes.
  virtual absl::Status Write(absl::Span<const uint8_t> bytes) = 0;
  // Bytes written so far.
  virtual size_t written() const = 0;
  // Stores the snapshot under a new id of the cache. FAILED_PRECONDITION unless exactly
  // total_bytes were written.
  virtual absl::StatusOr<SnapshotInfo> Commit() = 0;
};

}  // namespace kvmesh

#endif  // KVMESH_CACHE_TYPES_H_
