#include "service/executor.h"

#include <utility>

#include "grpcpp/server_context.h"
#include "service/common/convert.h"
#include "service/request_gate.h"

namespace kvmesh {

Executor::Executor(int num_threads, size_t max_queued)
    : num_threads_(num_threads), max_queued_(max_queued) {
  MutexLock lock(&mu_);
  workers_.reserve(num_threads);
  for (int i = 0; i < num_threads; ++i) {
    workers_.emplace_back([this] { WorkerLoop(); });
  }
}

Executor::~Executor() { Shutdown(); }

bool Executor::Submit(absl::AnyInvocable<void() &&> task) {
  {
    MutexLock lock(&mu_);
    if (shutting_down_ || queue_.size() >= max_queued_) {
      rejected_.fetch_add(1, std::memory_order_relaxed);
      return false;
    }
    queue_.push_back(std::move(task));
  }
  work_ready_.notify_one();
  return true;
}

size_t Executor::queued() const {
  MutexLock lock(&mu_);
  return queue_.size();
}

void Executor::Shutdown() {
  std::vector<std::thread> workers;
  {
    MutexLock lock(&mu_);
    shutting_down_ = true;
    workers = std::move(workers_);
    workers_.clear();
  }
  work_ready_.notify_all();
  // Workers leave only once the queue is empty, so every accepted task runs.
  for (std::thread& worker : workers) worker.join();
}

void Executor::WorkerLoop() {
  for (;;) {
    absl::AnyInvocable<void() &&> task;
    {
      MutexLock lock(&mu_);
      while (queue_.empty() && !shutting_down_) work_ready_.wait(mu_);
      if (queue_.empty()) return;  // shutting down and drained
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    std::move(task)();
  }
}

void RunUnaryOn(Executor* executor, UnaryCall* call, absl::AnyInvocable<absl::Status() &&> fn,
                const char* cancelled_message, absl::FunctionRef<grpc::Status()> busy) {
  const bool queued = executor->Submit([call, cancelled_message, fn = std::move(fn)]() mutable {
    if (call->context()->IsCancelled()) {
      call->Answer(grpc::Status(grpc::StatusCode::CANCELLED, cancelled_message));
      return;
    }
    call->Answer(ToGrpcStatus(std::move(fn)()));
  });
  if (!queued) call->Answer(busy());
}

}  // namespace kvmesh
