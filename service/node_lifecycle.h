// The lifecycle of kvmesh-node around what node_main.cc wires: the termination signals, the
// drain a SIGTERM starts (docs/api.md#drain), and the shutdown that follows it. Run
// (node_main.cc) builds the node, then calls these in order: BlockTerminationSignals before any
// thread starts, WaitForTermination once the node listens, DrainForShutdown, ShutDown.
#ifndef KVMESH_SERVICE_NODE_LIFECYCLE_H_
#define KVMESH_SERVICE_NODE_LIFECYCLE_H_

#include <signal.h>

#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "cache/mutex.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "service/cache_service.h"
#include "service/cluster/cluster_index.h"
#include "service/cluster/drain.h"
#include "service/cluster/drain_gate.h"
#include "service/cluster/leases.h"
#include "service/executor.h"
#include "service/peer_service.h"

namespace kvmesh {

// How long calls still running at shutdown may go on before they are cancelled, and how long
// gRPC may hold chunk slices of exports after that.
inline constexpr absl::Duration kShutdownGrace = absl::Seconds(5);

// Blocks SIGTERM and SIGINT in this thread, and so in every thread started from it afterwards
// (gRPC's, the executors', NCCL's), so that they reach only WaitForTermination; `signals` is
// the set. Call before any thread starts.
absl::Status BlockTerminationSignals(sigset_t* signals);

// Waits for one of `signals`; returns it.
absl::StatusOr<int> WaitForTermination(const sigset_t& signals);

// A pod being deleted: hands everything to the peers (Drainer::Drain, Mode::kShutdown) for up
// to `timeout`, then waits, within the same time, for the transfers peers are still pulling
// from this node (`leases`). Termination signals that come meanwhile are logged and do not cut
// the drain short; SIGKILL does. `signal` is the one that started it (for the log).
void DrainForShutdown(const sigset_t& signals, int signal, absl::Duration timeout, Drainer* drainer,
                      const LeaseTable* leases);

// What ShutDown stops. Servers and executors may be null (not started).
struct RunningNode {
  DrainGate* gate = nullptr;
  // Readiness: the client port's and the probe port's health, set under readiness_mu.
  Mutex* readiness_mu = nullptr;
  grpc::HealthCheckServiceInterface* health = nullptr;
  grpc::HealthCheckServiceInterface* probe_health = nullptr;
  grpc::HealthCheckServiceInterface* peer_health = nullptr;
  CacheServiceImpl* service = nullptr;
  PeerServiceImpl* peer_service = nullptr;
  ClusterIndex* cluster_index = nullptr;
  std::unique_ptr<grpc::Server>* server = nullptr;
  std::unique_ptr<grpc::Server>* peer_server = nullptr;
  std::unique_ptr<grpc::Server>* health_server = nullptr;
  // Shut down in this order once the servers stop taking calls.
  std::vector<Executor*> executors;
};

// Shuts the node down after `signal`: readiness and every health status turn NOT_SERVING (and
// nothing makes the node ready again), watchers end, calls still running get kShutdownGrace and
// are then cancelled while the executors finish what is queued, and the servers go. Returns the
// process's exit status; exits at once (without tearing down the caches) when gRPC still holds
// chunk slices of exports after the grace.
int ShutDown(const RunningNode& node, int signal);

}  // namespace kvmesh

#endif  // KVMESH_SERVICE_NODE_LIFECYCLE_H_
