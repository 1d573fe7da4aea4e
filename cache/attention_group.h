// AttentionGroup: the storage and metadata of one Attention layer group of a Cache.
//
// Cells form a pool shared by all sequences. Each cell holds one token's K and V in every layer
// of the group and a reference count: the number of sequences whose index points at it. A cell
// is free at count zero. Each sequence has an ordered index position -> cell, so every
// operation costs in proportion to the positions it touches, never to the pool size.
//
// Operations come in two halves: Plan*/Check* inspect and never mutate; Apply* mutate and can
// fail only on a device error. Cache runs every group's plan before any group's apply, which
// is what makes its operations all-or-nothing across groups.
//
// Thread safety: none. The owning Cache serializes access under its lock.
#ifndef KVMESH_CACHE_ATTENTION_GROUP_H_
#define KVMESH_CACHE_ATTENTION_GROUP_H_

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "absl/container/btree_map.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/types/span.h"
#include "cache/cache.h"
#include "cache/device/device.h"
#include "cache/spec.h"

namespace kvmesh {

class AttentionGroup {
 public:
  using Index = absl::btree_map<int32_t, int32_t>;  // position -> cell

  AttentionGroup(int index, const CacheSpec& spec, DeviceArena arena, Device* device);

  AttentionGroup(const AttentionGroup&) = delete;
  AttentionGroup& operator=(const AttentionGroup&) = delete;

  int index() const { return index_; }
  const AttentionGeometry& geometry() const { return geo_; }
  const AttentionSpec& spec() const { return spec_; }
  int64_t free_cells() const { return int64_t(free_.size()) + (geo_.cells - next_fresh_); }
  size_t arena_bytes() const { return arena_.size(); }

  // The index of `seq`, or nullptr when the group stores nothing for it.
  const Index* Find(int64_t seq) const;
  const absl::flat_hash_map<int64_t, Index>& sequences() const { return seqs_; }
  int32_t SharedCells(const Index& index) const;

  // ---- Append ---------------------------------------------------------------------------
  struct AppendPlan {
    std::vector<std::pair<int64_t, int64_t>> prune;  // (seq, drop positions below this)
    absl::flat_hash_set<int64_t> pruned_pending;     // non-batch sequences pruned to `last`
    int64_t freed = 0;                               // cells the pruning frees
  };
  // Sliding-window pruning for a batch whose sequences have the given lowest positions.
  AppendPlan PlanAppend(const absl::flat_hash_map<int64_t, int32_t>& batch_lowest) const;
  // RESOURCE_EXHAUSTED unless `num_tokens` cells are free after the plan's pruning.
  absl::Status CheckAppend(const AppendPlan& plan, int64_t num_tokens) const;
  // Appending is split so that Cache can write every group before committing any: WriteAppend
  // takes cells and scatters the rows of `tokens` from `payload` (this group's section) into
  // them; CommitAppend then prunes and indexes them, or AbandonAppend gives them back. Cells come
  // from the free pool first; only when it is short does WriteAppend apply the plan's pruning
  // early to reuse the cells it frees (then an abandoned append leaves that pruning done, with
  // metadata and data consistent).
  absl::Status WriteAppend(const AppendPlan& plan, absl::Span<const Token> tokens,
                           const uint8_t* payload, std::vector<int32_t>* cells);
  void CommitAppend(const AppendPlan& plan, absl::Span<const Token> tokens,
                    absl::Span<const int32_t> cells);
  void AbandonAppend(absl::Span<const int32_t> cells);

  // ---- Read -----------------------------------------------------------------------------
  // Stored positions of `seq` in [begin, end) and their cells.
  void Collect(int64_t seq, int64_t begin, int64_t end, std::vector<int32_t>* positions,
               std::vector<int32_t>* cells) const;
  size_t PayloadBytes(size_t num_tokens) const;
  absl::Status Gather(absl::Span<const int32_t> cells, uint8_t* dst) const;

  // ---- CopyPrefix -----------------------------------------------------------------------
  // Whether src has any stored position < length.
  bool HasPrefix(int64_t src_seq, int32_t length) const;
  void ApplyCopyPrefix(int64_t src_seq, int64_t dst_seq, int32_t length);

  // ---- Remove ---------------------------------------------------------------------------
  // FAILED_PRECONDITION when positions would move and rope is NONE; RESOURCE_EXHAUSTED when
  // the private copies of shared moved cells do not fit.
  absl::Status CheckRemove(int64_t seq, int32_t begin, std::optional<int32_t> end) const;
  absl::Status ApplyRemove(int64_t seq, int32_t begin, std::optional<int32_t> end);

  // ---- CanResume / Visible --------------------------------------------------------------
  bool CanResume(int64_t seq, int32_t pos) const;
  std::vector<int32_t> Visible(const Query& query) const;

 private:
  void ApplyPrune(const AppendPlan& plan);
  int32_t AllocateCell();
  void ReleaseCell(int32_t cell);
  bool limited_memory() const { return geo_.memory != kUnlimitedMemory; }

  const int index_;
  const AttentionSpec spec_;
  const DType dtype_;
  const AttentionGeometry geo_;
  Device* const device_;
  DeviceArena arena_;
  std::vector<Plane> planes_;    // K0, V0, K1, V1, ...: the payload order
  std::vector<Plane> k_planes_;  // K0, K1, ...

  std::vector<int32_t> refs_;  // per cell
  std::vector<int32_t> free_;  // released cells, reused first
  int64_t next_fresh_ = 0;     // cells >= this have never been used
  absl::flat_hash_map<int64_t, Index> seqs_;
  // Sequences changed since their last prune as non-batch sequences (sliding groups only):
  // pruning a sequence outside the batch drops below last+1-memory, which cannot change
  // until the sequence does, so only these need looking at.
  absl::flat_hash_set<int64_t> prune_pending_;
  bool pruned_early_ = false;  // WriteAppend applied the plan's pruning already
};

}  // namespace kvmesh

#endif  // KVMESH_CACHE_ATTENTION_GROUP_H_
