// Executor: a fixed pool of worker threads fed by a bounded FIFO queue. gRPC reactions post
// engine work here so that they never block gRPC's threads; a full queue is refused at once
// (Submit returns false) so the RPC can fail fast instead of piling up behind a slow device.
//
// RunUnaryOn is how the node's unary RPC handlers use an executor: the work runs there and
// answers the call.
//
// Thread safety: Submit, Shutdown and the accessors are thread-safe. Tasks may Submit further
// tasks. Shutdown (and so the destructor) must not run on one of the executor's workers.
#ifndef KVMESH_SERVICE_EXECUTOR_H_
#define KVMESH_SERVICE_EXECUTOR_H_

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "cache/mutex.h"
#include "grpcpp/support/status.h"

namespace kvmesh {

class Executor {
 public:
  // Starts `num_threads` workers (REQUIRES: >= 1). At most `max_queued` tasks wait for a worker
  // at any time (REQUIRES: >= 1); tasks already running do not count.
  Executor(int num_threads, size_t max_queued);
  ~Executor();

  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  // Queues `task` to run on a worker. Returns false, without running or keeping the task, when
  // the queue already holds max_queued tasks or Shutdown has begun.
  bool Submit(absl::AnyInvocable<void() &&> task);

  // Refuses new tasks, runs every task already queued, and joins the workers. Later calls
  // return at once. REQUIRES: not called from a worker.
  void Shutdown();

  int num_threads() const { return num_threads_; }
  size_t max_queued() const { return max_queued_; }
  size_t queued() const;
  // Tasks refused (Submit returned false) since the executor started.
  uint64_t rejected() const { return rejected_.load(std::memory_order_relaxed); }

 private:
  void WorkerLoop();

  const int num_threads_;
  const size_t max_queued_;
  std::atomic<uint64_t> rejected_{0};

  mutable Mutex mu_;
  std::condition_variable_any work_ready_;  // signalled on a new task and on shutdown
  std::deque<absl::AnyInvocable<void() &&>> queue_ ABSL_GUARDED_BY(mu_);
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;
  // Moved out under mu_ by the first Shutdown, which alone joins them.
  std::vector<std::thread> workers_ ABSL_GUARDED_BY(mu_);
};

class UnaryCall;  // service/request_gate.h

// Runs `fn` on `executor` and answers the unary call (a RequestGate's) with the status `fn`
// returns; with CANCELLED and `cancelled_message` instead when the call was cancelled before
// `fn` could start, and with busy() (UNAVAILABLE, built only then) when the executor refuses
// the task. `cancelled_message` is a string literal (the task keeps the pointer).
void RunUnaryOn(Executor* executor, UnaryCall* call, absl::AnyInvocable<absl::Status() &&> fn,
                const char* cancelled_message, absl::FunctionRef<grpc::Status()> busy);

}  // namespace kvmesh

#endif  // KVMESH_SERVICE_EXECUTOR_H_
