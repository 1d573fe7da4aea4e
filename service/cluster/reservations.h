// Reservations: what a migration holds while it moves a sequence or a snapshot away
// (docs/cluster.md). Migrate must not lose writes: once it has exported a sequence, an Append,
// Remove, Restore, CommitSpeculation or CopyPrefix into that sequence would change data that the
// target never receives and that the source then removes. So Migrate reserves the sequence, and
// while it is reserved those operations are ABORTED ("sequence under migration"); a second
// Migrate of it is ABORTED too. A Migrate that finds such operations running waits for them to
// finish (new ones are refused from the moment it reserves). Snapshots likewise: Drop, Merge and
// Split of a snapshot under migration are ABORTED.
//
// Thread safety: thread-safe. Guards and reservations are RAII and may be destroyed on any
// thread; the table must outlive them.
#ifndef KVMESH_SERVICE_CLUSTER_RESERVATIONS_H_
#define KVMESH_SERVICE_CLUSTER_RESERVATIONS_H_

#include <condition_variable>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "cache/mutex.h"

namespace kvmesh {

class Reservations {
 public:
  enum class Kind { kSequence, kSnapshot };

  // The `cache` argument of every call: the cache's tenant and name ("<tenant>/<name>"; a
  // tenant name has no '/'), since two tenants may each have a cache of one name. Messages name
  // the cache by its name alone.
  static std::string Key(const std::string& tenant, const std::string& name) {
    return tenant + "/" + name;
  }

  // Held by an operation that changes sequences (or consumes snapshots); releases on
  // destruction. Movable.
  class Guard {
   public:
    Guard() = default;
    Guard(Guard&& o) noexcept { *this = std::move(o); }
    Guard& operator=(Guard&& o) noexcept;
    ~Guard() { Reset(); }

   private:
    friend class Reservations;
    void Reset();
    Reservations* table_ = nullptr;
    Kind kind_ = Kind::kSequence;
    std::string cache_;
    std::vector<int64_t> ids_;
    bool reservation_ = false;  // a migration's reservation, not an operation's guard
  };

  Reservations() = default;
  Reservations(const Reservations&) = delete;
  Reservations& operator=(const Reservations&) = delete;

  // For an operation on `ids` of `cache` (duplicates allowed): ABORTED naming the first id under
  // migration and where it goes. `what` names the operation in the message.
  absl::StatusOr<Guard> BeginOperation(Kind kind, const std::string& cache,
                                       absl::Span<const int64_t> ids, const char* what);

  // For a migration of `id` to `target`: ABORTED when it is already under migration. Waits
  // until the operations running on it have finished; DEADLINE_EXCEEDED (and no reservation)
  // when they have not by `deadline`.
  absl::StatusOr<Guard> Reserve(Kind kind, const std::string& cache, int64_t id,
                                const std::string& target, absl::Time deadline);

  // Whether `id` is reserved now (for Export's check of a migration's sequence).
  bool IsReserved(Kind kind, const std::string& cache, int64_t id) const;

 private:
  using EntryKey = std::tuple<int, std::string, int64_t>;
  struct Entry {
    int operations = 0;        // running operations
    std::string migrating_to;  // non-empty while reserved
  };

  static const char* Noun(Kind kind) { return kind == Kind::kSequence ? "sequence" : "snapshot"; }
  // The name part of a Key.
  static std::string NameOf(const std::string& cache) { return cache.substr(cache.find('/') + 1); }
  void Drop(Kind kind, const std::string& cache, absl::Span<const int64_t> ids, bool reservation);

  mutable Mutex mu_;
  std::condition_variable_any drained_;  // an operation ended
  absl::flat_hash_map<EntryKey, Entry> entries_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvmesh

#endif  // KVMESH_SERVICE_CLUSTER_RESERVATIONS_H_
