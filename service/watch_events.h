// CacheService.WatchEvents (docs/api.md#watchevents): one server stream per watcher, fed from
// the node's EventLog.
//
// Each watcher has a thread of its own that reads the log from its cursor, keeps the events of
// the caller's tenant (and of the caches it asked for), and writes one message at a time: a
// watcher holds at most one message, whatever it watches, and writers of the log never wait for
// it. A watcher whose cursor the log has dropped (it read slower than the node changed) is
// ended with RESOURCE_EXHAUSTED (the log's bound), and resumes with a fresh listing. At most
// kMaxWatchers watchers run at once on a node (RESOURCE_EXHAUSTED beyond), so their threads stay
// few.
//
// Thread safety: StartWatch is thread-safe; the reactor it returns is the gate's.
#ifndef KVMESH_SERVICE_WATCH_EVENTS_H_
#define KVMESH_SERVICE_WATCH_EVENTS_H_

#include <atomic>
#include <cstddef>
#include <functional>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "cache/cache_registry.h"
#include "cache/event_log.h"
#include "grpcpp/grpcpp.h"
#include "kvmesh/v1/kvmesh.grpc.pb.h"
#include "service/auth.h"
#include "service/request_gate.h"

namespace kvmesh {

inline constexpr int kMaxWatchers = 64;
// A stream sends a message at least this often, one without events when nothing happened.
inline constexpr absl::Duration kWatchHeartbeat = absl::Seconds(1);
// A message holds events up to about this many bytes (one event more when it alone is larger).
inline constexpr size_t kWatchMessageBytes = size_t{1} << 20;

// Counts the watchers of a node, and ends them when it shuts down.
struct WatcherCount {
  // The most that may run at once (RESOURCE_EXHAUSTED beyond).
  int max = kMaxWatchers;
  std::atomic<int> running{0};
  // Set when the node shuts down (then EventLog::Wake): every watcher ends with UNAVAILABLE
  // rather than holding the server's shutdown for its grace period.
  std::atomic<bool> stopping{false};

  // Sets `stopping` and wakes the watchers reading `log` (may be null).
  void Stop(EventLog* log) {
    stopping.store(true);
    if (log != nullptr) log->Wake();
  }
};

// Whose events a watcher sees: the caller's tenant's, or (a peer building its index of the
// cluster, PeerService.WatchEvents) every tenant's, each event naming its tenant.
enum class WatchScope { kTenant, kAllTenants };

// The most caches one watcher may name in WatchEventsRequest.caches.
inline constexpr int kMaxWatchedCaches = 1024;

// The reactor of one WatchEvents call by `caller` (its error, when not OK, ends the call; `log`
// may then be null), served through a RequestGate (CacheService.WatchEvents and
// PeerService.WatchEvents, whose requests the services parse once they know the caller): it
// serializes its messages and writes them to `call`. `still_allowed`, when not null, is asked at
// least once a second whether the caller may still watch: its error ends the stream (a revoked
// token, a peer no longer a member). `registry`, `log` and `count` must outlive every call.
StreamReactor* StartWatch(StreamCall* call, const v1::WatchEventsRequest& request,
                          absl::StatusOr<Principal> caller, WatchScope scope,
                          CacheRegistry* registry, EventLog* log, WatcherCount* count,
                          std::function<absl::Status()> still_allowed = nullptr);

// The protobuf form of an event; its tenant only with kAllTenants (a tenant's watcher sees its
// own tenant's events only).
void EventToProto(const Event& event, WatchScope scope, v1::Event* out);

}  // namespace kvmesh

#endif  // KVMESH_SERVICE_WATCH_EVENTS_H_
