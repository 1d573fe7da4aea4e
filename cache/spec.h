// CacheSpec: the shape of one model's KV storage on a node (docs/api.md#caches), and the
// derived sizes every layer of kvmesh computes from it (cells per group, bytes per token,
// payload sizes). Plain value types; safe to copy and share between threads.
#ifndef KVMESH_CACHE_SPEC_H_
#define KVMESH_CACHE_SPEC_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cache/dtype.h"

namespace kvmesh {

// How keys are rotated by position, so that Remove can re-rotate shifted keys.
enum class RopeType { kNone, kNormal, kNeox };

struct RopeSpec {
  RopeType type = RopeType::kNone;
  int32_t dims = 0;         // rotated elements per head, even, <= head_dim_k
  float base = 10000.0f;    // theta base
  float freq_scale = 1.0f;  // multiplies every angle
  bool operator==(const RopeSpec& o) const;
};

enum class WindowKind { kFull, kSliding, kChunked };

struct WindowSpec {
  WindowKind kind = WindowKind::kFull;
  int32_t window = 0;  // kSliding: tokens visible to a query (> 0)
  int32_t memory = 0;  // kSliding: tokens kept per sequence; 0 means `window`
  int32_t chunk = 0;   // kChunked: chunk size (> 0)
  bool operator==(const WindowSpec& o) const;
};

struct AttentionSpec {
  int32_t num_kv_heads = 0;
  int32_t head_dim_k = 0;
  int32_t head_dim_v = 0;
  WindowSpec window;
  RopeSpec rope;
  bool operator==(const AttentionSpec& o) const;
};

// A per-sequence ring buffer of the last `max_size` tokens (mlx RotatingKVCache).
struct RotatingSpec {
  int32_t num_kv_heads = 0;
  int32_t head_dim_k = 0;
  int32_t head_dim_v = 0;
  int32_t max_size = 0;  // tokens kept per sequence, in [1, capacity]
  RopeSpec rope;
  bool operator==(const RotatingSpec& o) const;
};

// Per-sequence recurrent state (lfm2 HybridCache, mlx RecurrentCache): a conv state
// [conv_tail][conv_dim] in the cache's dtype and, when num_v_heads > 0, a gated-delta state
// [num_v_heads][head_v_dim][head_k_dim] in float32.
struct RecurrentSpec {
  int32_t conv_tail = 0;
  int32_t conv_dim = 0;
  int32_t num_v_heads = 0;  // 0: no delta state (head_v_dim and head_k_dim must be 0 too)
  int32_t head_v_dim = 0;
  int32_t head_k_dim = 0;
  bool operator==(const RecurrentSpec& o) const;
};

// Layer group kinds (docs/api.md#layer-groups). Every switch over it is exhaustive so the compiler
// finds the places a new kind must be handled.
enum class GroupKind { kAttention, kRotating, kRecurrent };

// What a cache does when an Append needs room that is not free (docs/api.md#eviction).
// kNone: the Append fails with RESOURCE_EXHAUSTED. kLru: it first evicts whole sequences that
// may go (not pinned, not in use; see Cache::SetRetention), lowest priority first and then
// least recently used, when that makes room.
enum class EvictionPolicy { kNone, kLru };
const char* EvictionPolicyName(EvictionPolicy policy);

const char* GroupKindName(GroupKind kind);

struct GroupSpec {
  int32_t num_layers = 0;
  GroupKind kind = GroupKind::kAttention;
  AttentionSpec attention;  // valid when kind == kAttention
  RotatingSpec rotating;    // valid when kind == kRotating
  RecurrentSpec recurrent;  // valid when kind == kRecurrent
  // Compares num_layers, kind and the fields of that kind only.
  bool operator==(const GroupSpec& o) const;
};

inline constexpr int32_t kDefaultTokenBlockSize = 16;
inline constexpr int32_t kMaxTokenBlockSize = 1 << 16;

struct CacheSpec {
  std::string name;
  DType dtype = DType::kF16;
  int32_t max_sequences = 0;
  int32_t capacity = 0;   // tokens per sequence
  int32_t max_batch = 0;  // largest number of tokens in one Append
  std::vector<GroupSpec> groups;
  // Tokens per block of a sequence's hash chain (cache/token_chain.h), [1, kMaxTokenBlockSize].
  // It shapes no storage, so it is not part of SpecFingerprint; operator== compares it.
  int32_t token_block_size = kDefaultTokenBlockSize;
  // Shapes no storage either (not in SpecFingerprint); operator== compares it.
  EvictionPolicy eviction = EvictionPolicy::kNone;
  bool operator==(const CacheSpec& o) const;
  bool operator!=(const CacheSpec& o) const { return !(*this == o); }
};

// Upper bounds that keep every derived size representable; requests beyond them are
// INVALID_ARGUMENT rather than an overflow.
inline constexpr int32_t kMaxGroups = 64;
inline constexpr int32_t kMaxLayersPerGroup = 1024;
inline constexpr int32_t kMaxHeads = 4096;
inline constexpr int32_t kMaxHeadDim = 8192;
inline constexpr int64_t kMaxCellsPerGroup = int64_t{1} << 24;  // keeps host metadata small
inline constexpr int32_t kMaxSequences = 1 << 20;
inline constexpr uint64_t kMaxCacheBytes = uint64_t{1} << 50;  // 1 PiB: anything larger is absurd
inline constexpr size_t kMaxNameLength = 128;
inline constexpr int32_t kMaxConvTail = 1024;
inline constexpr int32_t kMaxConvDim = 1 << 20;

// The most token ids a sequence keeps (cache/token_chain.h): as many positions as the largest
// Attention group has cells, or capacity when that is more, and at most kMaxCellsPerGroup.
// Ids of positions from there on are not kept.
int32_t TokenIdLimit(const CacheSpec& spec);

// Returns INVALID_ARGUMENT naming the first bad field, or OK.
absl::Status ValidateSpec(const CacheSpec& spec);

// The first field in which two specs differ, with both values, for error messages.
std::string DescribeSpecDifference(const CacheSpec& a, const CacheSpec& b);

// Sizes derived from a valid spec for one Attention group.
struct AttentionGeometry {
  int64_t cells = 0;       // cells in the group's pool
  int32_t memory = 0;      // effective per-sequence memory; kUnlimitedMemory when unlimited
  size_t k_row_bytes = 0;  // one token of K in one layer
  size_t v_row_bytes = 0;  // one token of V in one layer
  size_t bytes = 0;        // whole arena: num_layers * cells * (k_row + v_row)
};

inline constexpr int32_t kUnlimitedMemory = INT32_MAX;

// REQUIRES: ValidateSpec(spec).ok() and spec.groups[group].kind == kAttention.
AttentionGeometry ComputeAttentionGeometry(const CacheSpec& spec, int group);

// Sizes derived from a valid spec for one Rotating group: one ring of max_size rows per
// possible sequence.
struct RotatingGeometry {
  int32_t rings = 0;       // max_sequences
  int32_t max_size = 0;    // rows per ring
  size_t k_row_bytes = 0;  // one token of K in one layer
  size_t v_row_bytes = 0;
  size_t bytes = 0;  // num_layers * rings * max_size * (k_row + v_row)
};
// REQUIRES: ValidateSpec(spec).ok() and spec.groups[group].kind == kRotating.
RotatingGeometry ComputeRotatingGeometry(const CacheSpec& spec, int group);

// Sizes derived from a valid spec for one Recurrent group: one state slot per possible
// sequence.
struct RecurrentGeometry {
  int32_t slots = 0;       // max_sequences
  size_t conv_bytes = 0;   // conv state of one layer: conv_tail * conv_dim * dtype
  size_t delta_bytes = 0;  // delta state of one layer: heads * v * k * 4 (0 without delta)
  size_t state_bytes = 0;  // one sequence's state over all layers of the group
  size_t bytes = 0;        // slots * state_bytes
};
// REQUIRES: ValidateSpec(spec).ok() and spec.groups[group].kind == kRecurrent.
RecurrentGeometry ComputeRecurrentGeometry(const CacheSpec& spec, int group);

// Whether the cache has a Rotating or Recurrent group: then each sequence's Append must
// continue exactly at its offset.
bool RequiresContiguousPositions(const CacheSpec& spec);

// Bytes of the Append payload for `num_tokens` tokens of `num_sequences` distinct sequences.
// A speculative Append carries one recurrent state per token instead of one per sequence.
// REQUIRES: ValidateSpec(spec).ok().
size_t AppendPayloadBytes(const CacheSpec& spec, int64_t num_tokens, int64_t num_sequences,
                          bool speculative = false);

// Bytes of one token across all layers of group `group` (K and V); 0 for a Recurrent group.
size_t GroupTokenBytes(const CacheSpec& spec, int group);

// Bytes of one recurrent state across all layers of group `group`; 0 unless Recurrent.
size_t GroupStateBytes(const CacheSpec& spec, int group);

// Total device bytes a cache of this spec allocates. REQUIRES: ValidateSpec(spec).ok().
size_t CacheBytes(const CacheSpec& spec);

// Host memory a cache's bookkeeping may take beyond its device arenas, as a bound computed from
// the spec alone (docs/api.md#metadata-budget): each of max_sequences sequence slots is charged
// kSequenceMetadataBytes for what the cache keeps per live sequence (its last use and place in
// the eviction order, retention, pending and reservation entries, a token chain's fixed part)
// plus kGroupSequenceMetadataBytes per group (the group's entry for the sequence and its place
// in the group's ordered ids); each Attention cell kCellMetadataBytes (reference and pin
// counts, holder, free list), each Rotating ring and Recurrent state slot kSlotMetadataBytes.
// The per-sequence figures are what a sequence holding one position takes, measured with
// tests/bench/metadata_bench (docs/benchmarks.md), rounded up. What grows with the positions a
// sequence stores (runs of cells beyond the first, token ids and block hashes) is not in it.
inline constexpr uint64_t kSequenceMetadataBytes = 320;
inline constexpr uint64_t kGroupSequenceMetadataBytes = 160;
inline constexpr uint64_t kCellMetadataBytes = 20;
inline constexpr uint64_t kSlotMetadataBytes = 8;
// REQUIRES: ValidateSpec(spec).ok().
uint64_t CacheMetadataBytes(const CacheSpec& spec);

}  // namespace kvmesh

#endif  // KVMESH_CACHE_SPEC_H_
