// LocalServer: the node's end of the local data path (proto/kvmesh/v1/local.proto,
// docs/api.md#local-data-path). Workers on the same machine connect to a Unix-domain socket,
// authenticate as gRPC callers do, map their tenant's caches' memory (file descriptors passed
// with SCM_RIGHTS) and pin cells to read them in place.
//
// Bounds: at most max_sessions sessions (a connection beyond them is told RESOURCE_EXHAUSTED
// and closed), requests of at most 64 KiB, at most max_pins pins and max_plans Append plans per
// session (a plan's cells are the cache's, in its budget), a session that
// has not said Hello within hello_timeout ends. Nothing but Hello is read before the session is
// authenticated; a failed Hello ends the session.
//
// Thread safety: Start and the destructor from one thread; the counts from any.
// A thread accepts connections and one thread serves each session.
#ifndef KVMESH_SERVICE_LOCAL_SERVER_H_
#define KVMESH_SERVICE_LOCAL_SERVER_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "cache/cache_registry.h"
#include "cache/mutex.h"
#include "service/auth.h"

namespace kvmesh {

class LocalServer {
 public:
  // The largest request frame a session reads.
  static constexpr size_t kMaxRequestBytes = 64 << 10;

  struct Options {
    // Where the socket is made (an existing socket file there is replaced; any other file is
    // an error). Its mode is 0660: the worker must run as the node's user or group.
    std::string path;
    std::string node_name;
    const Authenticator* auth = nullptr;  // required
    CacheRegistry* registry = nullptr;    // required
    absl::Duration default_lease = absl::Seconds(30);
    absl::Duration max_lease = absl::Seconds(120);
    int max_sessions = 64;
    int max_pins = 1024;
    // Append plans a session may hold at once (each holds the cells of its tokens).
    int max_plans = 16;
    absl::Duration hello_timeout = absl::Seconds(5);
  };

  // Binds and listens. INVALID_ARGUMENT for a path that is too long or names something other
  // than a socket; UNAVAILABLE when it cannot bind.
  static absl::StatusOr<std::unique_ptr<LocalServer>> Start(Options options);

  // Closes the socket, ends every session (their pins go) and removes the socket file.
  ~LocalServer();
  LocalServer(const LocalServer&) = delete;
  LocalServer& operator=(const LocalServer&) = delete;

  const std::string& path() const { return options_.path; }
  // Sessions open now, and the pins and Append plans they hold.
  size_t sessions() const;
  size_t pins() const { return pins_.load(); }
  size_t plans() const { return plans_.load(); }
  // Since start: sessions accepted, requests answered with an error, Appends committed.
  uint64_t sessions_total() const { return sessions_total_.load(); }
  uint64_t refusals() const { return refusals_.load(); }
  uint64_t commits() const { return commits_.load(); }

 private:
  struct Session;
  LocalServer(Options options, int listen_fd);
  void AcceptLoop();
  void Serve(Session* session);

  const Options options_;
  const int listen_fd_;
  std::atomic<bool> stopping_{false};
  std::atomic<size_t> pins_{0};
  std::atomic<size_t> plans_{0};
  std::atomic<uint64_t> sessions_total_{0};
  std::atomic<uint64_t> refusals_{0};
  std::atomic<uint64_t> commits_{0};
  mutable Mutex mu_;
  std::vector<std::unique_ptr<Session>> sessions_ ABSL_GUARDED_BY(mu_);
  std::thread acceptor_;
};

}  // namespace kvmesh

#endif  // KVMESH_SERVICE_LOCAL_SERVER_H_
