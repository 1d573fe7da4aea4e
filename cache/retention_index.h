// RetentionIndex: the eviction policy of one cache, apart from the mechanism that evicts.
//
// It keeps each live sequence's retention (priority, pin, TTL) and its last use, and orders the
// unpinned sequences as the LRU policy evicts them: lowest priority first, then least recently
// used, then lowest id. It knows nothing of cells, groups or what is in use: the Cache asks it
// who comes first (Candidates) or whose TTL has run out (Expired), passes over those it may not
// evict now, weighs what evicting the others would free, and evicts. A tier below the device
// keeps an index of its own.
//
// Thread safety: the retentions (Set, Get, Forget, Expired) are guarded by the owner's lock
// (the Cache's mu_: held exclusively to change them, at least shared to read them). Uses are
// recorded under the index's own lock, so that operations holding the owner's lock shared may
// record them; the owner's lock is always taken first. A Uses or Candidates object holds the
// index's lock while it lives.
#ifndef KVMESH_CACHE_RETENTION_INDEX_H_
#define KVMESH_CACHE_RETENTION_INDEX_H_

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/btree_set.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "cache/mutex.h"
#include "cache/types.h"

namespace kvmesh {

class RetentionIndex {
 public:
  RetentionIndex() = default;
  RetentionIndex(const RetentionIndex&) = delete;
  RetentionIndex& operator=(const RetentionIndex&) = delete;

  // INVALID_ARGUMENT for a negative TTL.
  static absl::Status Validate(const Retention& retention);

  // Sets seq's retention; the default one forgets it. The order of candidates follows at
  // seq's next recorded use (a retention is set by an operation that records one).
  void Set(int64_t seq, const Retention& retention);
  // seq's retention: the default when none was set.
  Retention Get(int64_t seq) const;
  // Forgets seq's retention and last use: it stores nothing any more.
  void Forget(int64_t seq);

  // The last use recorded of seq; nullopt when none.
  std::optional<absl::Time> LastUse(int64_t seq) const;

  // The sequences whose TTL has run out at `now` (unused for at least their TTL), ascending.
  std::vector<int64_t> Expired(absl::Time now) const;

  // Records uses at one time, each with the sequence's retention of now.
  class Uses {
   public:
    Uses(const RetentionIndex* index, absl::Time now) ABSL_NO_THREAD_SAFETY_ANALYSIS;
    Uses(const Uses&) = delete;
    Uses& operator=(const Uses&) = delete;
    void Record(int64_t seq) ABSL_NO_THREAD_SAFETY_ANALYSIS;

   private:
    const RetentionIndex* const index_;
    const absl::Time now_;
    MutexLock lock_;
  };

  // The unpinned sequences in eviction order, one at a time. No use is recorded while it lives.
  class Candidates {
   public:
    explicit Candidates(const RetentionIndex* index) ABSL_NO_THREAD_SAFETY_ANALYSIS;
    Candidates(const Candidates&) = delete;
    Candidates& operator=(const Candidates&) = delete;
    // The next candidate; nullopt after the last.
    std::optional<int64_t> Next() ABSL_NO_THREAD_SAFETY_ANALYSIS;

   private:
    const RetentionIndex* const index_;
    MutexLock lock_;
    absl::btree_set<std::tuple<int32_t, absl::Time, int64_t>>::const_iterator next_;
  };

 private:
  struct Use {
    absl::Time time;
    int32_t priority = 0;
    bool pinned = false;
  };
  // (priority, last use, seq): the order of eviction.
  using Key = std::tuple<int32_t, absl::Time, int64_t>;

  void RecordUse(int64_t seq, absl::Time now) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // The sequences whose retention is not the default (guarded by the owner's lock).
  absl::flat_hash_map<int64_t, Retention> retention_;
  mutable Mutex mu_;
  // The last use of each live sequence that has one, with the priority and pin it had then,
  // and the unpinned ones in eviction order.
  mutable absl::flat_hash_map<int64_t, Use> last_used_ ABSL_GUARDED_BY(mu_);
  mutable absl::btree_set<Key> order_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvmesh

#endif  // KVMESH_CACHE_RETENTION_INDEX_H_
