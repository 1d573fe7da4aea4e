// One rank of a simulated NCCL communicator (nccl_sim.h has the model): its bootstrap, its
// connections to the other ranks, the send and receive operations posted on it, and the thread
// that moves their bytes.
//
// Threads: the communicator's own thread bootstraps it, then does all socket I/O: it queues the
// operations that ncclGroupEnd posted, writes the front send and reads into the front receive
// of each peer whose stream has reached them, exchanges the finalize messages and notices peers
// that went away. Callers' threads post operations, ask for the state and finalize, destroy or
// abort; the threads that drive the CUDA streams start operations (Start runs the copies of a
// rank's sends to itself) and wait for them.
//
// Why the thread does its socket I/O holding the communicator's mutex: Abort must guarantee
// that no byte is read into or written from a caller's buffer after it returns (the caller
// frees the buffers once the stream has drained). Every read and write is non-blocking and
// bounded (kMaxIoBytes), so the mutex is never held for long.
//
// Lifetime: a Communicator is shared by the handle (ncclComm_t) and by every operation on a
// stream (StreamOp), so a stream may reach an operation after its communicator was aborted or
// destroyed; Abort (at once) and Destroy (once finalized) stop the thread and close the
// connections.
//
// Thread safety: thread-safe. Lock order: cudasim's lock of a stream being run (held around
// StreamOp::Start and Poll), then a communicator's mu_, then the last-error lock (last_error.h).
// Nothing calls into cudasim with mu_ held, and the communicator's thread never calls it.
#ifndef KVMESH_TESTS_TESTING_NCCLSIM_COMMUNICATOR_H_
#define KVMESH_TESTS_TESTING_NCCLSIM_COMMUNICATOR_H_

#include <nccl.h>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <list>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "cache/mutex.h"
#include "tests/testing/cudasim/cuda_sim.h"
#include "tests/testing/ncclsim/fault_injection.h"
#include "tests/testing/ncclsim/socket.h"
#include "tests/testing/ncclsim/wire.h"

namespace ncclsim {

// The largest read or write of one system call (the time the thread holds a communicator's
// mutex is bounded by one of them).
inline constexpr size_t kMaxIoBytes = size_t{4} << 20;

// How many operations of one stream operation are not complete yet.
struct Completion {
  explicit Completion(size_t ops) : remaining(ops) {}
  std::atomic<size_t> remaining;
};

// One ncclSend or ncclRecv.
struct Op {
  bool send = false;
  int peer = 0;
  uint8_t* data = nullptr;  // device memory (const for a send)
  size_t bytes = 0;
  OpFault fault;
  std::shared_ptr<Completion> completion;  // set before it is posted
  // Guarded by the communicator's mutex once posted.
  bool started = false;  // its stream has reached it
  bool done = false;
  std::list<std::shared_ptr<Op>>::iterator pending_at;  // its entry in pending_ (until done)
};

class Communicator {
 public:
  // Creates rank `rank` of the `nranks`-rank communicator `id` on CUDA device `device` and
  // starts its thread, which bootstraps it. Null with *error (ncclSystemError) when the thread
  // or its eventfd cannot be made. `init_fault`: the async error init must end with.
  static std::shared_ptr<Communicator> Create(const IdLayout& id, int nranks, int rank, int device,
                                              bool blocking, std::optional<ncclResult_t> init_fault,
                                              std::string* error);
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;
  // REQUIRES: Abort or Destroy was called (the thread has stopped).
  ~Communicator() = default;

  int nranks() const { return nranks_; }
  int rank() const { return rank_; }
  bool blocking() const { return blocking_; }
  // "rank R of N (pid P, cuda:D)", for messages.
  const std::string& name() const { return name_; }

  // ncclCommGetAsyncError's state: the error, else ncclInProgress while initializing, queueing
  // posted operations or finalizing, else ncclSuccess.
  ncclResult_t AsyncError();
  // Blocks until initialization has ended; its result (with *error on failure).
  ncclResult_t WaitInit(std::string* error);
  // Whether new operations may be posted: ncclSuccess; the async error; ncclInvalidArgument
  // while the state is ncclInProgress (as NCCL answers a communicator used before its last call
  // completed, a finalize included); ncclInvalidUsage once finalized. *error says why when not
  // ncclSuccess.
  ncclResult_t CheckUsable(std::string* error);

  // Posts one group's operations of this communicator, in posting order (each with its
  // completion set). A non-blocking communicator hands them to its thread and reads
  // ncclInProgress until the thread has queued them.
  void Post(const std::vector<std::shared_ptr<Op>>& ops);
  // The stream reached `ops` (one stream operation's): they may move bytes now. Copies the
  // sends to this rank into the receives from it (paired in order; ncclGroupEnd checked them).
  void StartOps(const std::vector<std::shared_ptr<Op>>& ops);
  // Blocks until `completion` has no operation left.
  void WaitDone(const Completion& completion);
  // Makes `result` the async error (the first error sticks).
  void Fail(ncclResult_t result, const std::string& message);

  // ncclCommFinalize: flushes the posted operations, then exchanges finalize messages with every
  // peer. ncclInProgress for a non-blocking communicator; a blocking one waits and returns the
  // outcome. Refused as CheckUsable refuses operations.
  ncclResult_t Finalize(std::string* error);
  // ncclCommDestroy: finalizes first (blocking) when that was not done, then stops the thread
  // and closes the connections. A communicator in error or still initializing is aborted.
  void Destroy();
  // ncclCommAbort: completes every pending operation as a no-op, stops the thread, closes the
  // connections. Operations that a stream reaches later complete without touching memory.
  void Abort();

 private:
  // What the thread keeps of each other rank; the socket is touched by the thread only (and by
  // Stop after the thread has ended).
  struct Link {
    Fd fd;
    int pid = 0;
  };
  // Transfer state of each other rank, guarded by mu_.
  struct Peer {
    std::deque<std::shared_ptr<Op>> sends;  // posted, not complete, in posting order
    std::deque<std::shared_ptr<Op>> recvs;
    Frame out_frame;       // the frame being written
    size_t out_done = 0;   // bytes of out_frame and its payload written so far
    Frame in_frame;        // the frame being read
    size_t in_header = 0;  // bytes of in_frame read so far
    size_t in_done = 0;    // payload bytes read so far into the front receive
    bool finalize_sent = false;
    bool finalize_received = false;
    bool hangup_seen = false;  // the peer shut its side; data may still be buffered
  };

  Communicator(const IdLayout& id, int nranks, int rank, int device, bool blocking,
               std::optional<ncclResult_t> init_fault, Fd wake);

  // The thread: Bootstrap, then the transfer loop until Stop.
  void Run();
  // Registers with the root and connects to every other rank. *stopped when Stop interrupted it.
  ncclResult_t Bootstrap(std::string* error, bool* stopped);
  void TransferLoop();
  // Moves what can move for peer `rank` without blocking; the poll events it waits for.
  short ProgressLocked(int rank) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Each true when blocked on the socket (EAGAIN).
  bool SendLocked(int rank) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool RecvLocked(int rank) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The peer shut its side of an idle connection (or it failed): an error unless what it sent
  // is still to be read.
  void HangupLocked(int rank, short revents) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A failed read or write on peer `rank`'s connection (errno set, or 0 for end of file).
  void IoFailedLocked(int rank, const char* doing, bool end_of_file)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CheckFinalizedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CompleteLocked(const std::shared_ptr<Op>& op) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FailLocked(ncclResult_t result, const std::string& message)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // "rank R (pid P)", for messages about a peer.
  std::string PeerName(int rank) const;
  // Ends the thread and closes the connections.
  void Stop();
  // Initializing, queueing posted operations, or finalizing.
  bool InProgressLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // CheckUsable's answer.
  ncclResult_t CheckReadyLocked(std::string* error) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const IdLayout id_;
  const int nranks_;
  const int rank_;
  const bool blocking_;
  const std::optional<ncclResult_t> init_fault_;
  const std::string name_;
  const Fd wake_;  // eventfd: wakes the thread (work to do, or stop)
  std::thread thread_;
  std::vector<Link> links_;  // by rank; the thread's (see Link)

  kvmesh::Mutex mu_;
  std::condition_variable_any changed_;  // any state change a caller may wait for
  ncclResult_t error_ ABSL_GUARDED_BY(mu_) = ncclSuccess;
  std::string error_message_ ABSL_GUARDED_BY(mu_);
  bool initialized_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool aborted_ ABSL_GUARDED_BY(mu_) = false;
  // Groups handed to the thread (non-blocking) and their network operations, not yet queued.
  int launching_ ABSL_GUARDED_BY(mu_) = 0;
  std::deque<std::shared_ptr<Op>> handoff_ ABSL_GUARDED_BY(mu_);
  std::list<std::shared_ptr<Op>> pending_ ABSL_GUARDED_BY(mu_);  // posted, not complete
  enum class Finalizing { kNo, kRequested, kDone };
  Finalizing finalize_ ABSL_GUARDED_BY(mu_) = Finalizing::kNo;
  std::vector<Peer> peers_ ABSL_GUARDED_BY(mu_);  // by rank (own rank unused)
};

// The stream operation of one group's operations of one communicator on one stream.
class StreamOp : public cudasim::AsyncOp {
 public:
  StreamOp(std::shared_ptr<Communicator> comm, std::vector<std::shared_ptr<Op>> ops,
           std::shared_ptr<Completion> completion)
      : comm_(std::move(comm)), ops_(std::move(ops)), completion_(std::move(completion)) {}

  void Start() override { comm_->StartOps(ops_); }
  bool Poll(bool blocking) override;

 private:
  const std::shared_ptr<Communicator> comm_;
  const std::vector<std::shared_ptr<Op>> ops_;
  const std::shared_ptr<Completion> completion_;
};

}  // namespace ncclsim

#endif  // KVMESH_TESTS_TESTING_NCCLSIM_COMMUNICATOR_H_
