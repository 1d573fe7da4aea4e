// The parts of kvmesh-node that node_main.cc wires together and that need no flags: the TTL
// sweeper, the host:port and port-file helpers, the sizing of the in-flight budget, the device,
// the gRPC settings both servers share and the node's metrics collectors. Each takes what it
// needs as arguments; the objects themselves, and the order they are built and destroyed in,
// stay in Run (node_main.cc).
#ifndef KVMESH_SERVICE_NODE_WIRING_H_
#define KVMESH_SERVICE_NODE_WIRING_H_

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cache/cache_registry.h"
#include "cache/device/device.h"
#include "cache/event_log.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/resource_quota.h"
#include "service/cache_service.h"
#include "service/cluster/cluster_index.h"
#include "service/cluster/drain_gate.h"
#include "service/cluster/leases.h"
#include "service/common/metrics.h"
#include "service/executor.h"
#include "service/inflight_budget.h"
#include "service/local_server.h"

namespace kvmesh {

// Removes every cache's sequences idle past their TTL (CacheRegistry::ExpireIdle) once per
// interval, on a thread of its own, until destroyed.
class TtlSweeper {
 public:
  TtlSweeper(CacheRegistry* registry, absl::Duration interval) {
    if (interval <= absl::ZeroDuration()) return;
    thread_ = std::thread([this, registry, interval] {
      std::unique_lock<std::mutex> lock(mu_);
      while (!cv_.wait_for(lock, absl::ToChronoNanoseconds(interval), [&] { return stop_; })) {
        lock.unlock();
        registry->ExpireIdle(absl::Now());
        lock.lock();
      }
    });
  }
  ~TtlSweeper() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
      cv_.notify_all();
    }
    if (thread_.joinable()) thread_.join();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

// Splits "host:port" at its last ':' (host may be a bracketed IPv6 address); false when there
// is no ':' or nothing before it.
bool SplitHostPort(const std::string& address, std::string* host);

// This machine's host name; "kvmesh-node" when it has none.
std::string Hostname();

// Writes `port` to `path` through a temporary file and a rename, so that a reader polling for
// the file never sees it half-written.
bool WritePortFile(const std::string& path, int port);

// The in-flight budget (--inflight_budget) split between gRPC and kvmesh, and the HTTP/2
// stream window (--stream_window) that fits gRPC's part.
struct InflightSizes {
  uint64_t grpc_quota_bytes = 0;       // gRPC's quarter: its ResourceQuota
  uint64_t kvmesh_inflight_bytes = 0;  // kvmesh's three quarters: the InflightBudget
  uint64_t stream_window = 0;
};

// Sizes them from the flags' values (0: the defaults) for messages of up to `max_message`
// bytes. INVALID_ARGUMENT, with the message the node exits with, when they do not fit.
absl::StatusOr<InflightSizes> SizeInflight(uint64_t inflight_budget, uint64_t stream_window,
                                           uint64_t max_message);

// The device the caches live on: with backend "cuda" GPU `ordinal`, else host memory
// (`shareable`: cache arenas that workers map for the local data path: memfds on the host,
// CudaDeviceOptions::shareable on a GPU).
// The error carries the message the node exits with.
absl::StatusOr<std::unique_ptr<Device>> CreateNodeDevice(const std::string& backend, int ordinal,
                                                         size_t memory_budget,
                                                         size_t snapshot_budget,
                                                         size_t kept_arena_limit,
                                                         bool prefault_memory, bool shareable);

// Settings both servers share: the one gRPC quota, a fixed stream window, the RPC observer,
// the message size limits and no SO_REUSEPORT.
void ConfigureServerBuilder(grpc::ServerBuilder& builder, const grpc::ResourceQuota& grpc_quota,
                            Metrics* metrics, uint64_t max_message, uint64_t stream_window);

// What the node holds, read at every scrape (docs/operate.md#metrics). Everything captured
// outlives the metrics endpoint: Run (node_main.cc) stops it before they go.
struct NodeState {
  std::string name;
  std::string backend;
  const CacheRegistry* registry;
  const Device* device;
  const std::vector<std::pair<std::string, const Executor*>> executors;
  const InflightBudget* inflight;
  const LeaseTable* leases;
  const DrainGate* gate;
  const EventLog* events;
  const CacheServiceImpl* service;
  const ClusterIndex* cluster_index;  // null with --cluster_index=false
  const LocalServer* local_server;    // null without --local-socket
};

// Registers the collector of the node's own metrics (build, process, executors, in-flight
// budget, caches, events, cluster index, device, leases, drain, local data path) on `metrics`.
void AddNodeCollectors(Metrics* metrics, NodeState state);

}  // namespace kvmesh

#endif  // KVMESH_SERVICE_NODE_WIRING_H_
