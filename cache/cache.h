// Cache: one model's KV storage on a node (ARCHITECTURE.md §3). Holds the metadata of every
// layer group on the host and the tensors on a Device.
//
// Every mutating operation is all-or-nothing: it validates the whole request against the
// current state first and changes nothing when it returns an error. Error codes follow
// ARCHITECTURE.md §5 and messages name the offending values.
//
// Thread safety: all methods are thread-safe. Mutations take the cache's lock exclusively;
// Read, Visible, CanResume, ListSequences and Usage take it shared.
#ifndef KVMESH_CACHE_CACHE_H_
#define KVMESH_CACHE_CACHE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "cache/device/device.h"
#include "cache/mutex.h"
#include "cache/spec.h"

namespace kvmesh {

class AttentionGroup;

// One token of an Append batch.
struct Token {
  int64_t seq = 0;
  int32_t pos = 0;
};

// One row of a Visible request: which stored positions a query at `pos` attends to.
struct Query {
  int64_t seq = 0;
  int32_t pos = 0;
  bool non_causal = false;  // when set, positions after `pos` are visible too
};

struct ReadResult {
  // positions[g]: stored positions of group g returned, ascending.
  std::vector<std::vector<int32_t>> positions;
  // For each group in spec order, for each layer: K [T_g][heads][head_dim_k], then
  // V [T_g][heads][head_dim_v], in the cache's dtype (ARCHITECTURE.md §3 payload layout).
  std::string payload;
};

struct GroupSequenceInfo {
  int32_t stored = 0;  // positions stored in this group
  int32_t shared = 0;  // of those, cells also referenced by another sequence
  int32_t first = -1;  // lowest stored position, -1 when none
  int32_t last = -1;   // highest stored position, -1 when none
};

struct SequenceInfo {
  int64_t seq = 0;
  int32_t offset = 0;  // one past the largest stored position over all groups
  std::vector<GroupSequenceInfo> groups;
};

struct GroupUsage {
  int64_t cells_total = 0;
  int64_t cells_used = 0;  // cells referenced by at least one sequence
  int32_t memory = 0;      // effective per-sequence memory, kUnlimitedMemory when unlimited
  size_t bytes = 0;        // device bytes of the group's arena
};

struct CacheUsage {
  std::vector<GroupUsage> groups;
  int32_t sequences_live = 0;
  size_t bytes_held = 0;
};

class Cache {
 public:
  // Validates `spec` (INVALID_ARGUMENT) and allocates one arena per group on `device`
  // (RESOURCE_EXHAUSTED beyond its budget). `device` must outlive the cache.
  static absl::StatusOr<std::unique_ptr<Cache>> Create(const CacheSpec& spec, Device* device);
  ~Cache();

  Cache(const Cache&) = delete;
  Cache& operator=(const Cache&) = delete;

  const CacheSpec& spec() const { return spec_; }

  // Stores `tokens` with their K/V from `payload` (layout: AppendPayloadBytes). Sliding groups
  // prune first as the seed's updateSlidingWindow. Errors: INVALID_ARGUMENT for an empty or
  // oversized batch, negative seq/pos, positions not strictly increasing per sequence or already
  // stored, a payload of the wrong size; RESOURCE_EXHAUSTED when a group lacks free cells or the
  // batch would exceed max_sequences.
  absl::Status Append(absl::Span<const Token> tokens, absl::Span<const uint8_t> payload);

  // K/V of the stored positions of `seq` in [begin, end) (end absent: to the end).
  // NOT_FOUND when `seq` stores nothing; INVALID_ARGUMENT for begin < 0 or end < begin.
  absl::StatusOr<ReadResult> Read(int64_t seq, int32_t begin, std::optional<int32_t> end) const;

  // For each query, the stored positions of its sequence in group `group` that it attends to,
  // ascending. An unknown sequence sees nothing. INVALID_ARGUMENT for a bad group index or
  // negative seq/pos.
  absl::StatusOr<std::vector<std::vector<int32_t>>> Visible(int group,
                                                            absl::Span<const Query> queries) const;

  // dst's old contents go; dst gets src's stored positions < length, sharing src's cells.
  // INVALID_ARGUMENT for src == dst or negative arguments; RESOURCE_EXHAUSTED when dst would be
  // a new live sequence beyond max_sequences.
  absl::Status CopyPrefix(int64_t src_seq, int64_t dst_seq, int32_t length);

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

  CacheUsage Usage() const;

 private:
  explicit Cache(const CacheSpec& spec);

  absl::Status ValidateSeq(int64_t seq) const;
  absl::Status CheckUsableLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  int32_t LiveCountLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  bool IsLiveLocked(int64_t seq) const ABSL_SHARED_LOCKS_REQUIRED(mu_);

  const CacheSpec spec_;

  mutable Mutex mu_;
  std::vector<std::unique_ptr<AttentionGroup>> groups_ ABSL_GUARDED_BY(mu_);
  // Set when a device call failed half-way through rewriting stored data (Remove's copy or RoPE
  // shift): the metadata is consistent but some K/V bytes may not be. From then on Append,
  // Read, CopyPrefix and Remove fail with FAILED_PRECONDITION; the cache must be recreated.
  absl::Status device_failure_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvmesh

#endif  // KVMESH_CACHE_CACHE_H_
