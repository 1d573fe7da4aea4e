// EventLog: what changed on a node, in the order it changed (docs/api.md#watchevents): the
// block hashes of a sequence's token chain, removed ranges, snapshots created and dropped,
// migrations in and out, caches created and deleted, the node draining.
//
// Every event gets the next number, from 1 since the log was made; with the log's boot id
// (random, new each time the node starts) a consumer knows where it is and sees gaps and
// restarts. The log keeps the latest events within a byte and a count bound and drops the
// oldest beyond them: writers never wait for readers, and a reader that falls behind the
// oldest kept event learns so (OUT_OF_RANGE) and resynchronises from a listing.
//
// Events of one cache are published under that cache's lock, so their numbers follow the
// order of its changes; Cache::ListChains reports the number of the cache's last event with
// its listing, which tells a reader which later events the listing already reflects.
//
// Thread safety: thread-safe. Publish takes a short lock of its own and never blocks on
// readers; it may be called with a cache's lock held (the log never calls into a cache).
#ifndef KVMESH_CACHE_EVENT_LOG_H_
#define KVMESH_CACHE_EVENT_LOG_H_

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "cache/mutex.h"

namespace kvmesh {

enum class EventKind {
  // A sequence's block hashes changed: the first `kept_blocks` are as before, followed by
  // `block_hashes`; `offset` is the sequence's offset now, 0 when it is gone (then there are no
  // blocks).
  kBlocks,
  // Remove(seq, begin, end) ran (end -1: to the end).
  kRemoved,
  kSnapshotCreated,
  kSnapshotDropped,
  // A sequence arrived from `peer` (Migrate, Drain) or left for it.
  kMigratedIn,
  kMigratedOut,
  kCacheCreated,
  kCacheDeleted,
  // The node began draining (no cache).
  kDraining,
  // The cache removed a whole sequence by itself (`reason`: "lru", making room for an Append
  // under EvictionPolicy::kLru; "ttl", idle longer than its TTL); `offset` is what it held.
  kEvicted,
};

const char* EventKindName(EventKind kind);

struct Event {
  uint64_t number = 0;  // assigned by Publish
  absl::Time time;      // assigned by Publish
  EventKind kind = EventKind::kBlocks;
  std::string tenant;
  std::string cache;
  int64_t seq = -1;
  int32_t offset = 0;
  int32_t kept_blocks = 0;
  std::vector<uint64_t> block_hashes;
  int32_t begin = 0;
  int32_t end = -1;
  uint64_t snapshot = 0;
  std::string peer;
  // kBlocks and kCacheCreated: the cache's token block size (CacheSpec::token_block_size).
  int32_t token_block_size = 0;
  // kEvicted: why.
  std::string reason;

  // Bytes the event holds in the log, roughly.
  size_t bytes() const;
};

class EventLog {
 public:
  struct Options {
    size_t max_bytes = size_t{64} << 20;
    size_t max_events = size_t{1} << 20;
    // The process's boot id (the node's, as it reports it everywhere); empty: a random one.
    std::string boot_id;
  };
  EventLog() : EventLog(Options()) {}
  explicit EventLog(Options options);

  EventLog(const EventLog&) = delete;
  EventLog& operator=(const EventLog&) = delete;

  // Options::boot_id, or 32 random hex digits; fixed for the log's life.
  const std::string& boot_id() const { return boot_id_; }

  // Numbers the event and appends it, dropping the oldest events beyond the bounds; wakes
  // readers waiting in Wait. Returns the event's number.
  uint64_t Publish(Event event);

  // Up to `max_events` events numbered `from` and on (their bytes at most `max_bytes`, but at
  // least one event when there is one). OUT_OF_RANGE when events from `from` on were dropped
  // already (from < first_number()).
  absl::StatusOr<std::vector<Event>> Read(uint64_t from, size_t max_events, size_t max_bytes) const;

  // The number the next event will get, and the oldest one kept (next_number() when none).
  uint64_t next_number() const;
  uint64_t first_number() const;

  // Blocks until an event numbered above `after` exists, `deadline` passes, or Wake is called;
  // returns next_number() then.
  uint64_t Wait(uint64_t after, absl::Time deadline) const;
  // Wakes every Wait (a reader that has more to do than wait for events, or a shutdown). It
  // notifies under the log's lock, which the destructor takes too: a Wake from a gRPC thread
  // (a watcher's OnCancel) is then ordered before the log's destruction for TSan, which cannot
  // see gRPC's own ordering of the reaction before Server::Wait returns.
  void Wake();
  ~EventLog();

  // Events dropped for the bounds since the log was made.
  uint64_t dropped() const;

 private:
  const Options options_;
  const std::string boot_id_;
  mutable Mutex mu_;
  mutable std::condition_variable_any published_;
  std::deque<Event> events_ ABSL_GUARDED_BY(mu_);
  size_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t dropped_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t wakes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvmesh

#endif  // KVMESH_CACHE_EVENT_LOG_H_
