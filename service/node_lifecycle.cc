#include "service/node_lifecycle.h"

#include <pthread.h>
#include <string.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "service/common/log.h"
#include "transport/grpc_stream_transport.h"

namespace kvmesh {

absl::Status BlockTerminationSignals(sigset_t* signals) {
  sigemptyset(signals);
  sigaddset(signals, SIGTERM);
  sigaddset(signals, SIGINT);
  if (const int err = pthread_sigmask(SIG_BLOCK, signals, nullptr); err != 0) {
    return absl::InternalError(absl::StrCat("pthread_sigmask: ", std::strerror(err)));
  }
  return absl::OkStatus();
}

absl::StatusOr<int> WaitForTermination(const sigset_t& signals) {
  int signal = 0;
  if (const int err = sigwait(&signals, &signal); err != 0) {
    return absl::InternalError(absl::StrCat("sigwait: ", std::strerror(err)));
  }
  return signal;
}

void DrainForShutdown(const sigset_t& signals, int signal, absl::Duration timeout, Drainer* drainer,
                      const LeaseTable* leases) {
  Log(LogLevel::kInfo,
      absl::StrCat(strsignal(signal), ", draining for up to ", absl::ToInt64Milliseconds(timeout),
                   " ms before shutting down"));
  std::atomic<bool> drained{false};
  std::thread repeat_signals([&] {
    const timespec poll = {0, 100 * 1000 * 1000};
    while (!drained.load()) {
      const int again = sigtimedwait(&signals, nullptr, &poll);
      if (again > 0) {
        Log(LogLevel::kWarning,
            absl::StrCat(strsignal(again),
                         " while draining: the drain goes on (SIGKILL stops the node at once, "
                         "losing what it still holds)"));
      }
    }
  });
  const absl::Time drain_deadline = absl::Now() + timeout;
  (void)drainer->Drain(drain_deadline, Drainer::Mode::kShutdown);
  // Peers still fetching an export of this node (a cross-node CopyPrefix or a Migrate pulling
  // from here) get it to the end, within the drain's time: shutting the servers down would cut
  // their transfers off after the grace. A lease ends when its receiver releases it, or expires
  // when the receiver is gone.
  if (leases->size() > 0) {
    Log(LogLevel::kInfo, absl::StrCat("waiting for ", leases->size(),
                                      " transfers to peers to finish before shutting down"));
    while (leases->size() > 0 && absl::Now() < drain_deadline) {
      absl::SleepFor(absl::Milliseconds(20));
    }
    if (leases->size() > 0) {
      Log(LogLevel::kWarning,
          absl::StrCat(leases->size(),
                       " transfers to peers were still running at the drain's deadline"));
    }
  }
  drained.store(true);
  repeat_signals.join();
}

int ShutDown(const RunningNode& node, int signal) {
  Log(LogLevel::kInfo, absl::StrCat(strsignal(signal), ", shutting down"));
  // From here on nothing makes the node ready again (a Drain call with resume, during the grace
  // period), and the listener's references to Run's frame stay unused while it unwinds.
  node.gate->set_listener(nullptr);
  {
    MutexLock lock(node.readiness_mu);
    node.health->SetServingStatus(false);
    if (node.probe_health != nullptr) node.probe_health->SetServingStatus(false);
  }
  if (node.peer_health != nullptr) node.peer_health->SetServingStatus(false);
  // Calls still running get the grace period, then are cancelled. The executors keep running
  // meanwhile: queued tasks are what finish those calls (a Fetch stream whose chunk read is
  // queued on transfer_reads finishes when that read runs and sees the cancellation).
  const absl::Time grace_end = absl::Now() + kShutdownGrace;
  node.service->StopWatchers();
  node.peer_service->StopWatchers();
  if (node.cluster_index != nullptr) node.cluster_index->Stop();
  std::unique_ptr<grpc::Server>& server = *node.server;
  std::unique_ptr<grpc::Server>& peer_server = *node.peer_server;
  std::unique_ptr<grpc::Server>& health_server = *node.health_server;
  if (peer_server != nullptr) peer_server->Shutdown(absl::ToChronoTime(grace_end));
  server->Shutdown(absl::ToChronoTime(grace_end));
  if (health_server != nullptr) health_server->Shutdown(absl::ToChronoTime(grace_end));
  for (Executor* executor : node.executors) executor->Shutdown();
  server->Wait();
  if (peer_server != nullptr) peer_server->Wait();
  if (health_server != nullptr) health_server->Wait();
  // gRPC may still hold slices of grpc-stream chunks that point into exports; they must be gone
  // before the caches and the device that their memory comes from.
  server.reset();
  peer_server.reset();
  health_server.reset();
  if (!transport::AwaitPayloadSlicesReleased(absl::Now() + kShutdownGrace)) {
    Log(LogLevel::kError,
        absl::StrCat("gRPC still holds ", transport::PayloadSlicesHeld(),
                     " chunk slices of exports; exiting without tearing down the caches"));
    std::_Exit(EXIT_SUCCESS);
  }
  return EXIT_SUCCESS;
}

}  // namespace kvmesh
