// ClusterIndex: which of the other members' sequences hold which token blocks, so that a node
// answers LookupPrefix with LOOKUP_SCOPE_CLUSTER without asking every member (docs/cluster.md
// "Prefix index").
//
// One watcher thread per peer follows the peer's events (PeerService.WatchEvents, every
// tenant): a listing of every sequence's block hashes, then each change as it happens. What a
// peer announced is served only once its listing is complete, and forgotten as soon as its
// stream ends (the peer stopped, restarted, left, or could not be reached): the watcher then
// starts over with a fresh listing after retry_interval. A manager thread follows the
// membership: a member that joins gets a watcher, one that leaves loses it and its entries.
//
// The index holds block hashes only, never token ids: a candidate it names shares the prompt's
// leading block hashes in order, which a hash collision can fake. Verify asks the members that
// hold candidates to compare id by id (their own Cache::LookupPrefix).
//
// Memory: every peer's block hashes with their holders, about what each peer's own block index
// takes for its sequences (docs/benchmarks.md "Prefix lookup"); each peer bounds its own.
//
// Thread safety: thread-safe. The destructor stops and joins every thread.
#ifndef KVMESH_SERVICE_CLUSTER_CLUSTER_INDEX_H_
#define KVMESH_SERVICE_CLUSTER_CLUSTER_INDEX_H_

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "cache/block_index.h"
#include "cache/cache.h"
#include "cache/mutex.h"
#include "kvmesh/v1/kvmesh.pb.h"
#include "service/cluster/membership.h"

namespace kvmesh {

// The most matches one LookupPrefix returns.
inline constexpr int kMaxLookupMatches = 64;
// LookupPrefixRequest.max_matches as a count (0 is 1); INVALID_ARGUMENT outside
// [0, kMaxLookupMatches].
absl::StatusOr<int> LookupMatchCount(int32_t max_matches);

class ClusterIndex {
 public:
  struct Options {
    Membership* membership = nullptr;  // required; must outlive the index
    // How often the manager compares the watchers with the membership.
    absl::Duration refresh_interval = absl::Seconds(1);
    // How long a watcher whose stream ended waits before it watches its peer again.
    absl::Duration retry_interval = absl::Seconds(1);
    // A stream that brings nothing for this long is cancelled, and the peer forgotten: a peer
    // sends at least a heartbeat a second (kWatchHeartbeat), so silence means it cannot be
    // reached (a partition, a host that died without closing its connections).
    absl::Duration silence_timeout = absl::Seconds(5);
  };
  explicit ClusterIndex(Options options);
  ~ClusterIndex();
  ClusterIndex(const ClusterIndex&) = delete;
  ClusterIndex& operator=(const ClusterIndex&) = delete;

  // A sequence of a peer whose chain starts with the prompt's first `blocks` block hashes.
  struct Candidate {
    std::string node;
    int64_t seq = 0;
    int32_t blocks = 0;
    int32_t offset = 0;  // as the peer last announced it
  };
  // The peers' sequences of `tenant`'s cache `cache` (with token block size `block_size`) that
  // hold the longest runs of the prompt's block hashes `hashes`, at most `max_matches` per
  // peer, deepest first, then by node and seq. A peer's sequence counts only when its own
  // hashes [0, blocks) equal the prompt's, not merely its hash at the deepest block. At most
  // max(64, 4 * max_matches) sequences are compared per peer.
  // UNAVAILABLE once the index is stopped (the node is shutting down).
  absl::StatusOr<std::vector<Candidate>> Lookup(const std::string& tenant, const std::string& cache,
                                                int32_t block_size,
                                                absl::Span<const uint64_t> hashes,
                                                int max_matches) const;

  // Asks each of `nodes` for its own verified matches of `lookup` (PeerService.LookupPrefix for
  // `tenant`), in parallel, each by `deadline`. Appends the matches to `response` (verified) and
  // a NodeResult per node whose call failed to response->unverified.
  void Verify(const std::vector<std::string>& nodes, const std::string& tenant,
              const v1::LookupPrefixRequest& lookup, absl::Time deadline,
              v1::LookupPrefixResponse* response) const;

  // What the index holds of each peer it watches, by name.
  struct PeerState {
    std::string node;
    bool synced = false;     // its listing is complete and its entries are served
    std::string boot_id;     // of the stream that is synced
    int64_t sequences = 0;   // with at least one block
    int64_t blocks = 0;      // (sequence, block) entries
    uint64_t events = 0;     // applied since the watcher started
    uint64_t resyncs = 0;    // streams that ended and were started again
    std::string last_error;  // how the last stream ended, "" before any did
  };
  std::vector<PeerState> Peers() const;

  // Stops the manager and every watcher (their streams are cancelled); entries are forgotten.
  // Idempotent, but not to be called concurrently with itself; the destructor calls it.
  void Stop();

 private:
  // What one peer's stream has told: per (tenant, cache), each sequence's hashes and offset.
  struct SequenceEntry {
    int32_t offset = 0;
    std::vector<uint64_t> hashes;
  };
  struct CacheEntry {
    int32_t block_size = 0;
    absl::flat_hash_map<int64_t, SequenceEntry> sequences;
    BlockIndex index;
  };
  struct PeerData {
    std::string boot_id;
    absl::flat_hash_map<std::string, CacheEntry> caches;  // by tenant '\0' cache
    int64_t blocks = 0;
  };
  class Watcher;

  // Applies one event to `data`; false when the event contradicts what the stream said before
  // (the stream is then started over).
  static bool Apply(const v1::Event& event, PeerData* data);
  static void Lookup(const std::string& node, const PeerData& data, const std::string& key,
                     int32_t block_size, absl::Span<const uint64_t> hashes, int max_matches,
                     std::vector<Candidate>* out);

  void ManagerLoop();
  void Reconcile();

  const Options options_;

  mutable Mutex mu_;
  std::condition_variable_any wake_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::map<std::string, std::unique_ptr<Watcher>> watchers_ ABSL_GUARDED_BY(mu_);
  std::thread manager_;
};

// Adds `matches` of `node` to `response`.
void AddPrefixMatches(const std::string& node, const std::vector<PrefixMatch>& matches,
                      v1::LookupPrefixResponse* response);
// Orders response->matches (longest first; among equal lengths verified ones first, then by
// node and seq) and keeps the first `max_matches`.
void SortPrefixMatches(int max_matches, v1::LookupPrefixResponse* response);

}  // namespace kvmesh

#endif  // KVMESH_SERVICE_CLUSTER_CLUSTER_INDEX_H_
