// Cache: one model's KV storage on a node (docs/api.md). Holds the metadata of every
// layer group on the host and the tensors on a Device.
//
// Every mutating operation is all-or-nothing: it validates the whole request against the
// current state first and changes nothing when it returns an error. Error codes follow
// docs/api.md#error-codes and messages name the offending values.
//
// Thread safety: all methods are thread-safe. Mutations take the cache's lock exclusively;
// Read, Visible, CanResume, ListSequences, ListSnapshots and Usage take it shared.
//
// Where things live. The Cache is the one entry to the engine and holds the one lock (mu_).
// State that has a concern of its own lives in a part the Cache owns, each guarded by mu_:
//   RetentionIndex (retention_index.h)  the eviction policy: each sequence's retention and last
//                       use, and the order in which the LRU policy evicts; it has its own lock
//                       for uses, taken after mu_, so that readers under mu_ shared record them
//   PrefixIndex (prefix_index.h)        token chains, the block index and the prefix lookup
//   SnapshotStore (snapshot_store.h)    the snapshots by id
//   the layer groups (layer_group.h)    the data and the per-group metadata of every sequence
// The parts know nothing of each other. The Cache's definitions, split by concern (*Locked
// members expect mu_ held):
//   cache.cc            creation, the sequence table, room reservations, Read, Visible,
//                       CanResume, CopyPrefix, Remove, listings and usage
//   cache_append.cc     Append and its checks, AppendWriter, CommitSpeculation
//   cache_retention.cc  the eviction mechanism: what may be evicted now (not in use), what
//                       evicting frees, and evicting, for an Append's room and for TTL expiry
//   cache_tokens.cc     keeping the PrefixIndex in line with what sequences store, and the
//                       events the Cache publishes
//   cache_snapshots.cc  snapshots: take, restore, merge, split, drop, list
//   cache_transfer.cc   exports and imports between nodes (snapshots and sequences), read cursors
// Appends, transfers and the sequence table stay in the Cache: they act on every group and
// every part at once, under the one lock, and that is what keeps each operation all-or-nothing.
// The value types the Cache takes and returns are cache/types.h, which is all the layers below
// the Cache see of it (nothing below includes this header: tests/layering_test.sh).
#ifndef KVMESH_CACHE_CACHE_H_
#define KVMESH_CACHE_CACHE_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "cache/device/device.h"
#include "cache/event_log.h"
#include "cache/mutex.h"
#include "cache/prefix_index.h"
#include "cache/retention_index.h"
#include "cache/snapshot_store.h"
#include "cache/spec.h"
#include "cache/token_chain.h"
#include "cache/types.h"

namespace kvmesh {

struct AppendBatch;
struct ChunkFormat;
class Cache;
class LayerGroup;
struct SnapshotRecord;

// A wire image received for Cache::RestoreImport (Cache::BeginSequenceImport): Write, written
// and Commit as SnapshotImportWriter's, but Commit stores no snapshot. Destroying it before
// RestoreImport frees whatever it holds. One thread at a time; it keeps its cache alive.
class SequenceImport final : public SnapshotImportWriter {
 public:
  ~SequenceImport() override;
  absl::Status Write(absl::Span<const uint8_t> bytes) override { return writer_->Write(bytes); }
  size_t written() const override { return writer_->written(); }
  absl::StatusOr<SnapshotInfo> Commit() override { return writer_->Commit(); }
  // Whether the rows went straight into cells (decided when the header arrived).
  bool in_cells() const;

 private:
  friend class Cache;
  struct State;
  SequenceImport(std::shared_ptr<Cache> cache, std::shared_ptr<State> state)
      : cache_(std::move(cache)), state_(std::move(state)) {}

  const std::shared_ptr<Cache> cache_;  // kept alive: the writer writes into its cells
  const std::shared_ptr<State> state_;  // shared with the writer's callbacks
  std::unique_ptr<SnapshotImportWriter> writer_;
};

// One group's memory (or a writer's staging memory of a group) as another process maps it.
struct SharedGroup {
  GroupKind kind = GroupKind::kAttention;
  SharedArena memory;  // the device's descriptor: valid while the memory lives
  // In payload order (docs/api.md): row r of plane p is [offset + r * row_bytes, +row_bytes)
  // in the mapping; `cells` rows each.
  std::vector<Plane> planes;
  int64_t cells = 0;
};

// An Append whose payload arrives piece by piece (Cache::BeginAppend). Write takes the next
// bytes of the payload, in order; Commit, once all have arrived, makes the Append happen.
// Nothing any other operation sees changes before Commit: destroying the writer without it (or
// after a failed Write) frees whatever it held. Any error from Write is final: later calls
// return it. One thread at a time; it keeps its cache alive.
class AppendWriter {
 public:
  ~AppendWriter();
  AppendWriter(const AppendWriter&) = delete;
  AppendWriter& operator=(const AppendWriter&) = delete;

  // Appends `bytes` (host memory) to the payload. INVALID_ARGUMENT beyond size(); device errors
  // as Device::Scatter.
  absl::Status Write(absl::Span<const uint8_t> bytes);
  // The payload's size, and the bytes written so far.
  size_t size() const;
  size_t written() const;
  // Whether the bytes go straight into the cells the Append will take (decided by BeginAppend),
  // rather than into a host buffer of size() bytes.
  bool in_cells() const;
  // Whether each Write is a plain memcpy into host memory: a buffered writer, or cells on a
  // device whose memory is the host's. Otherwise each Write is a device copy that may wait for
  // the device (write few large pieces, off latency-sensitive threads).
  bool in_host_memory() const;
  // The most host memory the writer holds: size() when buffered; in cells, one row of the
  // largest plane (a row split between two writes waits there).
  size_t host_bytes() const;
  // In cells: per group, the cell each token of the batch goes to, in batch order (-1: a token
  // that a later one of the batch overwrites; its row is not stored), as rows of the group's
  // planes (Cache::SharedGroups). Empty when not in_cells().
  std::vector<std::vector<int32_t>> Cells() const;
  // In cells: per group, where Cells() are rows of staging memory of the writer's own rather
  // than of the group's planes (a speculative batch of a Rotating or Recurrent group, for an
  // in_place writer: its pending rows until CommitSpeculation), that memory for another process
  // to map; nullopt for the other groups. The errors of Device::Share.
  absl::StatusOr<std::vector<std::optional<SharedGroup>>> StagingMemory() const;
  // Commit of a payload written straight into Cells() by another party (the local data path)
  // instead of through Write: the same checks and outcome. FAILED_PRECONDITION unless in_cells()
  // and nothing went through Write.
  absl::Status CommitInPlace();
  // Cache::Append of the tokens and the payload written, judged now (the cache may have changed
  // since BeginAppend), with Append's errors. FAILED_PRECONDITION unless exactly size() bytes
  // were written (the writer stays usable: the rest may still come), or after an earlier Commit
  // or error. Once it got past that check the writer is used up, whatever the outcome.
  absl::Status Commit();

 private:
  friend class Cache;
  struct State;
  explicit AppendWriter(std::unique_ptr<State> state);
  // Frees the cells or the buffer it holds.
  void Abandon();

  std::unique_ptr<State> state_;
};

// A Read whose payload is copied out piece by piece after the call (Cache::OpenRead): what
// Read would return, as of the call, with the payload read by ReadAt. One thread at a time;
// it keeps its cache alive.
class ReadCursor {
 public:
  virtual ~ReadCursor() = default;
  // Read's positions and states (payload empty).
  virtual const ReadResult& header() const = 0;
  // Bytes of the payload Read would return.
  virtual size_t size() const = 0;
  // Copies payload bytes [offset, offset + dst.size()) into dst (host memory). OUT_OF_RANGE
  // past size(); device errors as Device::Gather.
  virtual absl::Status ReadAt(size_t offset, absl::Span<uint8_t> dst) = 0;
  // The payload's bytes from `offset` on where they lie in host memory, without a copy: the
  // longest contiguous run there, at most `max_bytes` (a pinned read's run ends at the end of
  // one plane of one run of cells). Empty when offset >= size(), max_bytes == 0, or the bytes
  // are not in host memory: use ReadAt then. The bytes stay valid and unchanged while the
  // cursor exists. Thread-safe, also against ReadAt.
  virtual absl::Span<const uint8_t> View(size_t offset, size_t max_bytes) const = 0;
};

// A cursor over a Read already done (`result`, its payload kept and viewed in place).
std::unique_ptr<ReadCursor> NewCopiedReadCursor(ReadResult result);

struct SplitResult {
  std::optional<SnapshotInfo> parent;  // [from, at), absent when nothing lies below `at`
  std::optional<SnapshotInfo> child;   // [at, to), or the whole snapshot when a group cannot split
};

class Cache {
 public:
  // Validates `spec` (INVALID_ARGUMENT) and allocates one arena per group on `device`
  // (RESOURCE_EXHAUSTED beyond its budget). `device` must outlive the cache. Its sequences'
  // token chains are seeded for `tenant` (TokenHashSeed); `token_hash_bits` < 64 is a test
  // hook that forces hash collisions (TokenHasher::bits).
  // With `events` (not owned; it must outlive the cache), the cache publishes there what
  // changes (cache/event_log.h): block hashes of its chains, Removes, snapshots.
  static absl::StatusOr<std::unique_ptr<Cache>> Create(const CacheSpec& spec, Device* device,
                                                       absl::string_view tenant = kDefaultTenant,
                                                       int token_hash_bits = 64,
                                                       EventLog* events = nullptr);
  const std::string& tenant() const { return tenant_; }
  ~Cache();

  Cache(const Cache&) = delete;
  Cache& operator=(const Cache&) = delete;

  const CacheSpec& spec() const { return spec_; }

  // Stores `tokens` with their K/V from `payload` (layout: AppendPayloadBytes). Sliding groups
  // prune first as the seed's updateSlidingWindow; Recurrent groups take each sequence's state
  // after the batch from the payload. Errors: INVALID_ARGUMENT for an empty or oversized batch,
  // negative seq/pos, positions not strictly increasing per sequence or already stored, a
  // sequence not continuing at its offset in a cache with Rotating or Recurrent groups, a
  // payload of the wrong size; RESOURCE_EXHAUSTED when a group lacks free cells or the batch
  // would exceed max_sequences; ABORTED for a sequence with pending speculative tokens.
  //
  // With `speculative`, the tokens are pending: Read, Visible and CanResume see them, and
  // CommitSpeculation keeps a prefix of them. Each token's position must be past everything the
  // sequence stores, a Recurrent group's section carries one state per token (the state after
  // that token), and a sequence holds at most max_batch pending tokens (RESOURCE_EXHAUSTED).
  // Speculative Appends to a sequence may follow one another; a plain Append may not.
  absl::Status Append(absl::Span<const Token> tokens, absl::Span<const uint8_t> payload,
                      bool speculative = false);
  // Append of the payload that `pieces` form in order (a message as the network received it):
  // where the Append's cells lie in host memory each piece is copied from where it lies into
  // them; otherwise the pieces are gathered into one host buffer first.
  absl::Status AppendPieces(absl::Span<const Token> tokens,
                            absl::Span<const absl::Span<const uint8_t>> pieces,
                            bool speculative = false);

  // Append(tokens, <payload_bytes bytes written later>, speculative): the batch is checked now
  // as Append checks it (with its errors, including a payload_bytes of the wrong size), and
  // again when AppendWriter::Commit makes it happen. Where every group can reserve an Append's
  // cells and they are free without pruning a sliding window, the writer takes them now and
  // writes the payload into them as it arrives (without the cache's lock), so that Commit only
  // indexes them; they count as used meanwhile, and other operations, on the batch's sequences
  // too, go on. Otherwise the writer keeps the payload in a host buffer and Commit appends it.
  // With `in_place` (a local worker's Append plan, whose rows another process writes), the
  // writer takes its rows now or fails: FAILED_PRECONDITION where a group cannot reserve them
  // (room only by pruning a sliding window or by evicting), RESOURCE_EXHAUSTED where a Rotating
  // or Recurrent group has too few free rings or state slots to stage them. Rotating and
  // Recurrent groups stage a plain batch's rows in free units that their sequences take, or copy
  // from, at commit, and a speculative batch's in a chunk of shareable memory (StagingMemory)
  // that becomes the tokens' pending rows.
  static absl::StatusOr<std::unique_ptr<AppendWriter>> BeginAppend(
      const std::shared_ptr<Cache>& cache, absl::Span<const Token> tokens, size_t payload_bytes,
      bool speculative = false, bool in_place = false);

  // Keeps the first `accepted` pending tokens of `seq` and discards the others in every group
  // (the seed's Speculation.Commit). FAILED_PRECONDITION when `seq` has no pending tokens;
  // INVALID_ARGUMENT when accepted < 0 or more than are pending.
  absl::Status CommitSpeculation(int64_t seq, int32_t accepted);

  // K/V of the stored positions of `seq` in [begin, end) (end absent: to the end).
  // NOT_FOUND when `seq` stores nothing; INVALID_ARGUMENT for begin < 0 or end < begin.
  absl::StatusOr<ReadResult> Read(int64_t seq, int32_t begin, std::optional<int32_t> end) const;
  // The same, after `admit` has accepted the payload's size in bytes: it runs under the cache's
  // lock before the payload is allocated, and an error from it is returned as it is.
  absl::StatusOr<ReadResult> Read(
      int64_t seq, int32_t begin, std::optional<int32_t> end,
      absl::FunctionRef<absl::Status(size_t payload_bytes)> admit) const;

  // For each query, the stored positions of its sequence in group `group` that it attends to,
  // ascending. An unknown sequence sees nothing. INVALID_ARGUMENT for a bad group index or
  // negative seq/pos.
  absl::StatusOr<std::vector<std::vector<int32_t>>> Visible(int group,
                                                            absl::Span<const Query> queries) const;
  // The same, after `admit` has accepted an upper bound of the positions the answer lists in
  // all, found without listing them (O(log n) per query; exact for sequences stored without
  // gaps and for Rotating groups). `admit` runs under the cache's lock, before any position is
  // listed; an error from it is returned as it is. The caller bounds the answer's time and
  // memory this way: many queries over long sequences would otherwise take without limit.
  absl::StatusOr<std::vector<std::vector<int32_t>>> Visible(
      int group, absl::Span<const Query> queries,
      absl::FunctionRef<absl::Status(int64_t max_positions)> admit) const;
  // The same answer as maximal ranges of consecutive positions: a query over a sequence stored
  // without gaps is one range whatever its length. `admit` is given an upper bound of the
  // ranges listed in all (at most the positions' bound; for Attention groups, also at most the
  // sequence's runs of consecutive positions in consecutive cells).
  absl::StatusOr<std::vector<std::vector<PositionRange>>> VisibleRanges(
      int group, absl::Span<const Query> queries,
      absl::FunctionRef<absl::Status(int64_t max_ranges)> admit) const;

  // dst's old contents go; dst gets src's stored positions < length, sharing src's cells.
  // INVALID_ARGUMENT for src == dst or negative arguments; RESOURCE_EXHAUSTED when dst would be
  // a new live sequence beyond max_sequences.
  absl::Status CopyPrefix(int64_t src_seq, int64_t dst_seq, int32_t length) {
    return CopyPrefix(src_seq, dst_seq, length, /*require_src_offset=*/0).status();
  }
  // The same, and FAILED_PRECONDITION (nothing changed) unless src's offset is at least
  // `require_src_offset` (0: no condition): a caller that recorded how far src reached cannot
  // empty dst from a src that has since been removed or truncated. Returns dst's offset after
  // the copy (0 when it got nothing). The arguments are checked by CheckCopyPrefixCondition.
  absl::StatusOr<int32_t> CopyPrefix(int64_t src_seq, int64_t dst_seq, int32_t length,
                                     int32_t require_src_offset);
  // INVALID_ARGUMENT for a negative require_src_offset, and for one > 0 with length 0 (a copy
  // of nothing empties dst whatever src holds, so it has nothing to require of src).
  static absl::Status CheckCopyPrefixCondition(int32_t length, int32_t require_src_offset);

  // Drops positions [begin, end) (end absent: truncate). Later positions move down by
  // end - begin and their keys are re-rotated; cells shared with other sequences are copied
  // first. INVALID_ARGUMENT for begin < 0 or begin > end; FAILED_PRECONDITION when positions
  // would move in a group with rope NONE; RESOURCE_EXHAUSTED when the private copies of shared
  // cells do not fit. Removing from a sequence that stores nothing is a no-op.
  absl::Status Remove(int64_t seq, int32_t begin, std::optional<int32_t> end);

  // Whether a forward pass can continue `seq` at `pos` (AND over groups of the seed's rule).
  absl::StatusOr<bool> CanResume(int64_t seq, int32_t pos) const;

  // Live sequences in ascending id order.
  std::vector<SequenceInfo> ListSequences() const;
  // One page of that listing: the live sequences with ids >= `first`, ascending, at most
  // `limit` of them (0 is taken as 1), and whether more follow. Found through each group's
  // ordered ids under the shared lock, so a page costs O(groups x limit x log n) time and
  // holds `limit` entries, however many sequences the cache has.
  struct SequencePage {
    std::vector<SequenceInfo> sequences;
    bool more = false;
  };
  SequencePage ListSequences(int64_t first, size_t limit) const;
  // The token chain of `seq` (cache/token_chain.h); empty when it has none.
  TokenChain Tokens(int64_t seq) const;
  // The sequences whose exact prefixes (docs/api.md#tokens) share the longest prefixes with
  // the prompt `tokens`, longest first, then by seq: at most `max_matches`, each at least one
  // whole block long, each compared id by id with the prompt (a hash collision never makes a
  // match). Found through the block index: the prompt's block hashes are computed without the
  // lock, then looked up one block after another until one is missing. Equal lengths come in
  // ascending seq. At most max(64, 4 * max_matches) candidates are compared: among more
  // sequences that share a block, the matches come from those compared. INVALID_ARGUMENT for a
  // negative id or max_matches < 1.
  absl::StatusOr<std::vector<PrefixMatch>> LookupPrefix(absl::Span<const int32_t> tokens,
                                                        int max_matches) const;
  // The block hashes of the prompt `tokens` as this cache chains them (docs/api.md#tokens): one
  // per whole block, up to the most ids a chain keeps. INVALID_ARGUMENT for a negative id.
  absl::StatusOr<std::vector<uint64_t>> PromptHashes(absl::Span<const int32_t> tokens) const;
  TokenIndexStats TokenIndex() const;
  // Publishes `last` (CACHE_DELETED, by the registry) and then nothing more: an operation
  // that still holds the cache after its deletion publishes no event under its name, where a
  // new cache of that name may live by then.
  void DetachEvents(Event last);
  // Every sequence with at least one block hash, ascending, and the number of the last event
  // the cache published (0: none) as of the listing: a reader of the event log applies the
  // cache's later events only.
  ChainListing ListChains() const;
  // What the token chains of this cache are hashed with.
  const TokenHasher& token_hasher() const { return hasher_; }
  // The ListSequences entry of `seq` alone, nullopt when it stores nothing: costs what `seq`
  // holds, not what the other sequences hold (a cross-node copy or migration of one sequence).
  std::optional<SequenceInfo> GetSequence(int64_t seq) const;
  // Whether `seq` stores anything (positions, a state or pending tokens) in any group.
  bool IsLive(int64_t seq) const;

  CacheUsage Usage() const;
  // Per group, in spec order: cells (Recurrent: state slots) that more than one sequence
  // references, as CopyPrefix leaves them. Walks every cell: for monitoring, not per request.
  std::vector<int64_t> SharedCells() const;

  // ---- Retention and eviction (docs/api.md#eviction) -------------------------------------
  // Sets how long `seq` is kept. NOT_FOUND when seq stores nothing (a sequence gets the default
  // retention whenever it becomes live); INVALID_ARGUMENT for a negative seq or ttl. Counts as
  // a use of seq. A sequence "is used" by every operation that names it: Append, Read,
  // Visible, CanResume, CopyPrefix (both ends), Remove, Restore, Snapshot, CommitSpeculation,
  // SetRetention; a lookup that finds it is not a use.
  absl::Status SetRetention(int64_t seq, const Retention& retention);
  // A sequence the cache may never evict or expire, beyond its own rules (a node: one under
  // migration). Asked under the cache's lock; it must not call into the cache. Set it before
  // the cache is shared, or from one thread while no Append runs.
  void SetEvictionFilter(std::function<bool(int64_t seq)> may_evict);
  // Removes every sequence whose TTL has passed since its last use as of `now`, except those
  // in use (pending speculative tokens, an Append writing, cells pinned by a transfer or a
  // read, a room reservation, refused by the eviction filter): they are looked at again by the
  // next call. Each removal publishes EVICTED with reason "ttl". Returns the sequences removed,
  // ascending.
  std::vector<int64_t> ExpireIdle(absl::Time now);
  // Sequences evicted (reason "lru") and expired (reason "ttl") since the cache was created.
  struct EvictionCounts {
    int64_t lru = 0;
    int64_t ttl = 0;
  };
  EvictionCounts Evictions() const;

  // ---- Room reservations ----------------------------------------------------------------
  // Sets aside room for `seq` to hold `positions` positions until `expires`, so that a long
  // prefill sent in pieces cannot be starved half-way by other sequences: a sequence slot when
  // seq stores nothing, and in each Attention group the cells those positions still need
  // beyond what seq stores (at most the group's per-sequence memory). Other sequences'
  // operations see the room as used; operations on seq itself (and a batch that includes it)
  // may use it. As seq grows the room it holds back shrinks; the reservation lasts until
  // `expires`, until replaced by another Reserve of seq, or until one with positions 0 drops
  // it. RESOURCE_EXHAUSTED (with a Shortage) when the room is not free now, leaving any
  // earlier reservation of seq as it was; INVALID_ARGUMENT for negative arguments.
  absl::Status Reserve(int64_t seq, int32_t positions, absl::Time expires);

  struct RoomReservation {
    int64_t seq = 0;
    int32_t positions = 0;
    absl::Time expires;
  };
  // The reservations in force, ascending by seq.
  std::vector<RoomReservation> Reservations() const;

  // ---- Snapshots (mlx Snapshot/Restore/Merge/Split semantics per group) -----------------
  // Copies `seq`'s data from `from_offset` to its offset into the device's snapshot pool:
  // Attention groups the stored positions in [from, offset), Rotating groups the whole window
  // with its ring index, Recurrent groups the whole state. NOT_FOUND for an unknown sequence;
  // FAILED_PRECONDITION when from_offset >= offset or a Recurrent state is INVALID; ABORTED
  // while the sequence has pending speculative tokens; RESOURCE_EXHAUSTED when the snapshot
  // pool is full.
  //
  // With `to`, on a cache of Attention groups only, the snapshot stops there: it holds the
  // positions in [from_offset, min(to, offset)) and is what SplitSnapshot(that snapshot, to)
  // would leave as the parent, without copying (or charging the pool for) the positions past
  // `to`. INVALID_ARGUMENT when `to` <= from_offset or the cache has a Rotating or Recurrent
  // group (a ring or a state cannot be cut at a position).
  absl::StatusOr<SnapshotInfo> Snapshot(int64_t seq, int32_t from_offset,
                                        std::optional<int32_t> to = std::nullopt);

  // Whether restoring a snapshot holding positions[g] positions in each group g into `seq`,
  // replacing all it stores, would find room now: a sequence slot when `seq` is new (as
  // max_sequences allows) and free cells. The receiver of a cross-node copy asks this before
  // any byte moves; Restore checks again once the bytes are there. Under LRU, room that
  // evicting would make counts as room (the Restore evicts, not this check). RESOURCE_EXHAUSTED
  // saying what is short; ABORTED while `seq` has pending tokens; `what` names the operation.
  absl::Status CheckRoomForSequence(int64_t seq, absl::Span<const int64_t> positions,
                                    const char* what);

  // Without a snapshot: rewinds `seq` to `target` using its own data (Attention: target <=
  // offset; Rotating: target == offset, or before the ring wrapped; Recurrent: target ==
  // offset). With one: rewinds to the snapshot's start, writes its data and clamps to
  // `target`; FAILED_PRECONDITION when target > snapshot end, when the sequence's offset <
  // snapshot start (Attention), when a clamped Rotating window would be incomplete, or when a
  // Recurrent target != snapshot end. `seq` may be any sequence of the cache. NOT_FOUND for an
  // unknown snapshot; ABORTED while `seq` has pending tokens; RESOURCE_EXHAUSTED when cells or
  // sequences run out. The snapshot stays. `options`: see RestoreOptions.
  absl::Status Restore(int64_t seq, std::optional<uint64_t> snapshot_id, int32_t target,
                       const RestoreOptions& options = {});

  // [a,b) + [b,c) -> [a,c): Attention groups concatenate (INVALID_ARGUMENT unless the parent
  // ends where the child starts), Rotating and Recurrent groups keep the child. Consumes both;
  // the result has a new id. INVALID_ARGUMENT when parent == child; NOT_FOUND for either.
  absl::StatusOr<SnapshotInfo> MergeSnapshots(uint64_t parent, uint64_t child);

  // Splits [a,c) at `at` into [a,at) and [at,c). When a group cannot split (Rotating,
  // Recurrent), there is no parent and the whole snapshot is the child; at <= a gives no parent,
  // at >= c no child. Consumes the input; results have new ids. NOT_FOUND for an unknown id.
  absl::StatusOr<SplitResult> SplitSnapshot(uint64_t id, int32_t at);

  // NOT_FOUND for an unknown id.
  absl::Status DropSnapshot(uint64_t id);

  // All snapshots of the cache in ascending id order.
  std::vector<SnapshotInfo> ListSnapshots() const;
  // One page of that listing: the snapshots with ids >= `first`, ascending, at most `limit`
  // (0 is taken as 1), and whether more follow; O(log n + limit) under the shared lock.
  struct SnapshotPage {
    std::vector<SnapshotInfo> snapshots;
    bool more = false;
  };
  SnapshotPage ListSnapshots(uint64_t first, size_t limit) const;

  // ---- Moving snapshots between nodes (docs/cluster.md) ---------------------------------
  // A snapshot travels as one self-describing byte string, its "wire image": a header (format
  // version, a fingerprint of the spec, the snapshot's range, per-group metadata: positions,
  // ring index, state) followed by the data rows of every group and plane. ImportSnapshot on a
  // cache with an equal spec turns it back into an identical snapshot (Restore of it then
  // writes the same bytes as a Restore of the original).
  //
  // OpenSnapshotExport pins snapshot `id`'s data (the reader shares its chunks, so a later
  // DropSnapshot, Merge or Split does not free them) and returns a reader of its wire image;
  // NOT_FOUND for an unknown id. The reader is independent of the cache's lock and may be used
  // from any thread, one call at a time; it must not outlive the cache's Device.
  absl::StatusOr<std::unique_ptr<SnapshotExportReader>> OpenSnapshotExport(uint64_t id) const;

  // Starts receiving a wire image of `total_bytes` bytes, written in order with
  // SnapshotImportWriter::Write and turned into a snapshot of this cache by Commit.
  // INVALID_ARGUMENT when total_bytes is smaller than any header.
  absl::StatusOr<std::unique_ptr<SnapshotImportWriter>> BeginSnapshotImport(size_t total_bytes);

  // ---- Moving a sequence between nodes without a snapshot copy ---------------------------
  // In a cache whose groups all hold positions in cells (Attention only: lends_cells()), a
  // sequence moves between nodes without the copy into a snapshot on the sender and the copy
  // out of one on the receiver. On a cache with other groups both calls below do exactly that
  // copy instead, so callers use them alike.
  //
  // The wire image of Snapshot(seq, from_offset, to) (its id 0), with the same arguments and
  // errors except for the snapshot pool, read straight from the sequence's cells: they are
  // pinned, neither freed nor written in place, until the reader is gone (the reader keeps
  // `cache` alive, and a transfer's reference to the reader keeps it). The cells count as used
  // meanwhile, and their bytes as export_bytes (not as snapshot bytes).
  // With `require_offset` > 0, FAILED_PRECONDITION unless seq's offset is at least that,
  // checked under the same lock as the data is taken (a cross-node CopyPrefix's precondition).
  static absl::StatusOr<std::unique_ptr<SnapshotExportReader>> OpenSequenceExport(
      const std::shared_ptr<Cache>& cache, int64_t seq, int32_t from_offset,
      std::optional<int32_t> to, int32_t require_offset = 0);

  // Receives a wire image as BeginSnapshotImport does, but for RestoreImport rather than as a
  // stored snapshot: once the header has arrived, the rows go straight into free cells, pinned
  // for the import, when there are enough (otherwise into the snapshot pool, as a snapshot's
  // would). Commit stores nothing and returns the image's SnapshotInfo with id 0.
  static absl::StatusOr<std::unique_ptr<SequenceImport>> BeginSequenceImport(
      const std::shared_ptr<Cache>& cache, size_t total_bytes);

  // Restore(seq, <the committed import>, target), with the same checks and errors, where the
  // cells written by the import become the sequence's without a copy. A refusal changes
  // nothing, the import included; once restored (or after a device error) the import is used
  // up: its cells are free again unless the sequence took them. FAILED_PRECONDITION when
  // `import` is not committed, was used, or is another cache's.
  absl::Status RestoreImport(int64_t seq, SequenceImport& import, int32_t target,
                             const RestoreOptions& options = {});

  // Whether every group lends cells (see above).
  bool lends_cells() const { return lends_cells_; }
  // Whether AppendPieces copies each piece from where it lies into the cells (a cache of
  // Attention groups in host memory), rather than gathering the pieces into a payload-sized
  // host buffer first.
  bool appends_pieces_in_place() const { return pieces_in_place_; }
  // Whether AppendPieces of `pieces` pieces gathers them into a payload-sized host buffer (a
  // second copy of the payload while it runs).
  bool GathersPieces(size_t pieces) const { return pieces > 1 && !pieces_in_place_; }

  // Read(seq, begin, end) with the same checks and errors, but without copying the payload
  // at once: in a cache that lends cells, the cells read are pinned (as OpenSequenceExport
  // pins them) and ReadAt gathers from them later, so a caller can send a large payload chunk
  // by chunk while holding one chunk; other caches read the payload into the cursor at once
  // (without Read's `admit`: a caller that bounds memory reads such caches with Read). The
  // cursor keeps the cache alive, and its pinned cells stay used (not in export_bytes) until
  // it goes, even after the cache is deleted from its registry.
  static absl::StatusOr<std::unique_ptr<ReadCursor>> OpenRead(const std::shared_ptr<Cache>& cache,
                                                              int64_t seq, int32_t begin,
                                                              std::optional<int32_t> end);

  // ---- The local data path ---------------------------------------------------------------
  // A process on the same machine maps the groups' memory (SharedGroups) and reads cells in
  // place (PinCells). Only on a device that shares its memory (HostDevice with shareable).

  using SharedGroup = ::kvmesh::SharedGroup;
  // Every group's, in spec order. The errors of Device::Share.
  absl::StatusOr<std::vector<SharedGroup>> SharedGroups() const;

  // Cells a reader uses in place: pinned (neither freed, nor written in place, nor evicted
  // with their sequence) while `hold`, or a copy of it, lives; after that they are the cache's
  // again and may hold anything.
  struct PinnedCells {
    // Per group, in spec order: the positions of the range the group holds, ascending, and
    // the cell of each (the row of the group's planes).
    std::vector<std::vector<int32_t>> positions;
    std::vector<std::vector<int32_t>> cells;
    // Per group, per query of PinCells: the pinned positions the query attends to, as
    // VisibleRanges answers them (maximal ranges, ascending) cut to the pinned range.
    std::vector<std::vector<std::vector<PositionRange>>> visible;
    std::shared_ptr<const void> hold;
  };
  // The most ranges one PinCells may answer for its queries, over every group, each query of a
  // group counting one at least (what its answer costs even when it sees nothing).
  static constexpr int64_t kMaxPinVisibleRanges = int64_t{1} << 18;
  // Pins the cells of seq's positions in [begin, end) (end absent: all), with Read's checks and
  // errors. A Rotating group pins the sequence's ring (cells: the ring rows of its window's
  // positions), a Recurrent group its state slot (one cell, at position offset - 1, when the
  // range reaches the offset); FAILED_PRECONDITION where pending speculative rows of such a
  // group lie in the range (they are outside the group's memory). Counts as a use of seq. With
  // `queries` (positions of queries of seq), also what each attends to, seen at the same moment as
  // the cells (the seed's StartForward mask): INVALID_ARGUMENT for a negative one,
  // RESOURCE_EXHAUSTED when the answer could exceed kMaxPinVisibleRanges ranges (checked before
  // anything is built).
  static absl::StatusOr<PinnedCells> PinCells(const std::shared_ptr<Cache>& cache, int64_t seq,
                                              int32_t begin, std::optional<int32_t> end,
                                              absl::Span<const int32_t> queries = {});

 private:
  friend class SequenceImport;
  friend class AppendWriter;
  Cache(const CacheSpec& spec, const TokenHasher& hasher);

  // Brings `seq`'s token chain in line with what it stores now: dropped when seq is not live,
  // cut at its offset, and rehashed; the block index follows. Every change to a chain ends
  // with it.
  void SyncTokensLocked(int64_t seq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Replaces `seq`'s chain by `chain` (then SyncTokensLocked), or drops it, in the index too.
  void SetChainLocked(int64_t seq, TokenChain chain) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DropChainLocked(int64_t seq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Publishes `change` of seq's block hashes as a BLOCKS event (nothing when there is none).
  void PublishBlocksLocked(int64_t seq, std::optional<PrefixIndex::BlocksChange> change)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Records a committed Append's token ids in its sequences' chains.
  void RecordTokensLocked(const AppendBatch& batch) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The token chain `seq` gets from a Restore of `record` (null: a rewind) to `target`.
  void RestoreTokensLocked(int64_t seq, const SnapshotRecord* record, int32_t target)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Append's checks of the batch that need no lock, into *batch (whose tokens are `tokens`) and
  // *count (tokens per sequence).
  absl::Status CheckAppendBatch(absl::Span<const Token> tokens, size_t payload_bytes,
                                bool speculative, AppendBatch* batch,
                                absl::flat_hash_map<int64_t, int32_t>* count) const;
  // Append's group checks and plans (after CheckAppendLocked), pending_first refreshed; on an
  // error every group has abandoned its plan.
  absl::Status PrepareAppendLocked(AppendBatch& batch) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sets batch.pending_first from pending_: what sliding-window pruning must not pass.
  void RefreshPendingFirstLocked(AppendBatch& batch) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // AppendWriter::Commit of a writer in cells, and its Abandon.
  absl::Status CommitReservedAppend(AppendWriter::State& state);
  void AbandonReservedAppend(AppendWriter::State& state);

  // Records a use now (SequenceInfo::last_used) of those of `seqs` that are live.
  void TouchLocked(absl::Span<const int64_t> seqs) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  void TouchQueriesLocked(absl::Span<const Query> queries) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Forgets `seq`'s retention and last use when it stores nothing any more. Every operation
  // that may empty a sequence ends with it.
  void ForgetIfDeadLocked(int64_t seq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether `seq` may be evicted or expired now (not in use; see ExpireIdle). `lru`: also not
  // pinned.
  bool EvictableLocked(int64_t seq, bool lru, absl::Time now) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Removes the whole of each of `seqs` and publishes EVICTED with `reason` for each.
  void EvictLocked(absl::Span<const int64_t> seqs, const char* reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // CheckAppendLocked and PrepareAppendLocked of `batch`; under EvictionPolicy::kLru, when they
  // refuse it for room (cells, rings, state slots, sequence slots) and evicting the fewest
  // sequences in eviction order would make room, with `may_evict` evicts them and prepares
  // (kEvictedAndPrepared), without it evicts nothing and prepares nothing (kWouldEvict). When
  // no eviction would make room the refusal stands and nothing is evicted.
  enum class Admission { kPrepared, kEvictedAndPrepared, kWouldEvict };
  absl::StatusOr<Admission> AdmitAppendLocked(AppendBatch& batch,
                                              const absl::flat_hash_map<int64_t, int32_t>& count,
                                              bool may_evict) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The fewest sequences in eviction order, none of `own`, whose eviction would let `recheck`
  // (an operation's room checks, which count the groups' held_back units and held_sequences_,
  // and leave nothing prepared) pass, where it refused with `refusal`; nullopt when evicting
  // every evictable sequence would not.
  std::optional<std::vector<int64_t>> PlanEvictionLocked(absl::Span<const int64_t> own,
                                                         absl::FunctionRef<absl::Status()> recheck,
                                                         absl::Status refusal)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // For an operation other than Append (CopyPrefix, Restore) whose room checks `check` refused
  // with `refusal`: under EvictionPolicy::kLru, evicts what PlanEvictionLocked names and
  // returns check() again (without `evict`: OK, evicting nothing, where the eviction would make
  // room: a check before the operation's bytes arrive); otherwise, or when no eviction would
  // make room, the refusal.
  absl::Status MakeRoomLocked(absl::Status refusal, absl::Span<const int64_t> own,
                              absl::FunctionRef<absl::Status()> check, bool evict = true)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::Status ValidateSeq(int64_t seq) const;
  absl::Status CheckUsableLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // ABORTED when `seq` has pending speculative tokens; `what` names the refused operation.
  absl::Status CheckNotPendingLocked(int64_t seq, const char* what) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  int32_t LiveCountLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  bool IsLiveLocked(int64_t seq) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  SequenceInfo SequenceInfoLocked(int64_t seq) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  int64_t VisibleBoundLocked(int group, absl::Span<const Query> queries) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // One past the largest position any group holds for `seq` (pending included).
  int32_t OffsetLocked(int64_t seq) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // For one operation on `seqs` under the exclusive lock: drops expired room reservations and
  // holds back, in every group and among sequence slots, what the others' reservations keep.
  // The returned guard (which must not outlive the lock) gives it back.
  class HeldBack {
   public:
    explicit HeldBack(Cache* cache) : cache_(cache) {}
    HeldBack(const HeldBack&) = delete;
    HeldBack& operator=(const HeldBack&) = delete;
    ~HeldBack();

   private:
    Cache* cache_;
  };
  [[nodiscard]] HeldBack HoldBackLocked(absl::Span<const int64_t> seqs)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // FAILED_PRECONDITION unless seq's offset is at least `required` (0: always OK).
  absl::Status CheckOffsetAtLeastLocked(int64_t seq, int32_t required) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Append's checks that need the lock (count: tokens per sequence of the batch).
  absl::Status CheckAppendLocked(const AppendBatch& batch,
                                 const absl::flat_hash_map<int64_t, int32_t>& count) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Each group's section of `payload`, given the sections' sizes.
  static std::vector<const uint8_t*> Sections(absl::Span<const uint8_t> payload,
                                              absl::Span<const size_t> section_bytes);
  // Append under the lock throughout, for caches with a group that cannot reserve.
  absl::Status WriteAndCommitAppendLocked(const AppendBatch& batch,
                                          absl::Span<const uint8_t* const> sections)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Live sequences plus those an Append in flight is about to make live: what max_sequences
  // bounds.
  int32_t ClaimedCountLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // RESOURCE_EXHAUSTED when making `seq` live would exceed max_sequences.
  absl::Status CheckRoomForLocked(int64_t seq, const char* what) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Waits (releasing mu_ meanwhile) until no Append in flight writes to any of `seqs`. An
  // operation that changes a sequence calls it first, before it looks at anything.
  void AwaitNotAppendingLocked(absl::Span<const int64_t> seqs) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Records a device error that left stored data damaged; returns it.
  absl::Status FailLocked(absl::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  SnapshotInfo InfoLocked(const SnapshotRecord& record) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  absl::StatusOr<const SnapshotRecord*> FindSnapshotLocked(uint64_t id) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Gives `record` a new id and stores it.
  SnapshotInfo AddSnapshotLocked(SnapshotRecord record) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EraseSnapshotLocked(uint64_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Publishes `event` of this cache to events_ (when there is one).
  void PublishLocked(Event event) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Snapshot's checks of its arguments; then, under the lock, of the sequence. The latter
  // returns the snapshot's end.
  absl::Status CheckSnapshotArgs(int64_t seq, int32_t from_offset, std::optional<int32_t> to) const;
  // Snapshot(seq, from_offset, to), refused (FAILED_PRECONDITION) unless seq's offset is at
  // least `require_offset`.
  absl::StatusOr<SnapshotInfo> SnapshotRequiring(int64_t seq, int32_t from_offset,
                                                 std::optional<int32_t> to, int32_t require_offset);
  absl::StatusOr<int32_t> CheckSnapshotLocked(int64_t seq, int32_t from_offset,
                                              std::optional<int32_t> to) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Restore's work once the snapshot is found (record null: a rewind without one).
  absl::Status RestoreLocked(int64_t seq, const SnapshotRecord* record, int32_t target,
                             const RestoreOptions& options) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // BeginSequenceImport's callbacks: pins free cells for the image's rows (or returns false),
  // and stores the complete record in `state`.
  absl::StatusOr<bool> PlaceImport(SequenceImport::State& state, SnapshotRecord* record);
  SnapshotInfo CommitImport(SequenceImport::State& state, SnapshotRecord record);
  // Drops a pin of each of `cells` of group `group` (LayerGroup::Unpin).
  void UnpinCells(size_t group, absl::Span<const int32_t> cells);
  // The last of a PinRecordLocked record's pins of `seq` went.
  void EndRead(int64_t seq);
  // Pins `seq`'s cells of positions in [from, to) in every group (all lend cells) and returns
  // them as a record whose chunks unpin them when the last reference goes.
  // `self` is this cache, which the chunks keep alive.
  SnapshotRecord PinRecordLocked(const std::shared_ptr<Cache>& self, int64_t seq, int32_t from,
                                 int64_t to, std::vector<ChunkFormat>* formats)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Read's checks of its arguments.
  absl::Status CheckReadArgs(int64_t seq, int32_t begin, std::optional<int32_t> end) const;
  // After an Append's reservations committed with `committed`: records the batch; an error
  // (a device error in a commit's copy, after the sequences changed) fails the cache.
  absl::Status FinishReservedAppendLocked(const AppendBatch& batch, absl::Status committed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const CacheSpec spec_;
  const bool contiguous_;     // has a Rotating or Recurrent group
  const bool has_attention_;  // has an Attention group
  const TokenHasher hasher_;
  const int32_t token_limit_;  // TokenIdLimit(spec_)
  // Every group can reserve an Append's cells and have its bytes written without mu_ held.
  bool reserved_append_ = false;
  // Every group lends cells to transfers (OpenSequenceExport, BeginSequenceImport).
  bool lends_cells_ = false;
  // Every group can reserve a plain batch's rows for a writer in another process
  // (LayerGroup::SupportsInPlaceAppend), and pin a sequence's rows in place (PinsInPlace).
  bool in_place_append_ = false;
  bool pins_in_place_ = false;
  // reserved_append_, and every group's cells lie in host memory (AppendPieces).
  bool pieces_in_place_ = false;

  mutable Mutex mu_;
  std::vector<std::unique_ptr<LayerGroup>> groups_ ABSL_GUARDED_BY(mu_);
  // Sequences with pending speculative tokens: their pending positions, ascending.
  absl::flat_hash_map<int64_t, std::vector<int32_t>> pending_ ABSL_GUARDED_BY(mu_);
  // Token chains, their block hashes and the prefix lookup.
  PrefixIndex tokens_ ABSL_GUARDED_BY(mu_);
  std::string tenant_;
  EventLog* events_ ABSL_GUARDED_BY(mu_) = nullptr;
  uint64_t last_event_ ABSL_GUARDED_BY(mu_) = 0;  // the number of the last event published
  // Sequences whose Append is writing its bytes with mu_ released: their new cells are taken
  // but in no index yet. appended_ is notified whenever one leaves.
  absl::flat_hash_set<int64_t> appending_ ABSL_GUARDED_BY(mu_);
  // Room reservations by sequence (Reserve), and the sequence slots HoldBackLocked holds back
  // for the operation under way (0 otherwise).
  absl::flat_hash_map<int64_t, RoomReservation> room_ ABSL_GUARDED_BY(mu_);
  // Sequences being read in place (PinRecordLocked: Reads, exports, local pins), with how many
  // records pin them: never evicted meanwhile.
  absl::flat_hash_map<int64_t, int32_t> read_pins_ ABSL_GUARDED_BY(mu_);
  // The eviction policy: retentions, last uses and the order of eviction (its own lock for
  // uses, taken after mu_).
  RetentionIndex retention_ ABSL_GUARDED_BY(mu_);
  std::function<bool(int64_t)> may_evict_ ABSL_GUARDED_BY(mu_);
  EvictionCounts evictions_ ABSL_GUARDED_BY(mu_);
  int32_t held_sequences_ ABSL_GUARDED_BY(mu_) = 0;
  mutable std::condition_variable_any appended_;
  SnapshotStore snapshots_ ABSL_GUARDED_BY(mu_);
  // Set when a device call failed half-way through rewriting stored data (Remove's copy or RoPE
  // shift, an in-place Append, a Restore, a commit): the metadata is consistent but some bytes
  // may not be. From then on data operations fail with FAILED_PRECONDITION; the cache must be
  // recreated.
  absl::Status device_failure_ ABSL_GUARDED_BY(mu_);
  // Data bytes of the snapshots that open export readers pin; shared with the readers, which
  // may outlive the cache.
  const std::shared_ptr<std::atomic<size_t>> export_bytes_ =
      std::make_shared<std::atomic<size_t>>(0);
};

}  // namespace kvmesh

#endif  // KVMESH_CACHE_CACHE_H_
