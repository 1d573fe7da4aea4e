// NCCL communicators for the nccl transport (docs/cluster.md, docs/api.md#transports), without gRPC:
// NcclComm owns one communicator (non-blocking init, async-error polling under a deadline,
// ncclCommAbort on error or timeout) with its CUDA stream and staging buffers, and moves a
// payload with ncclSend/ncclRecv in chunks; NcclCommPool keeps one communicator per peer key,
// reuses it across transfers and closes idle ones. The gRPC side (unique-id exchange, the
// Transport) is transport/nccl_transport.h.
//
// Why non-blocking communicators everywhere: a blocking NCCL call on a peer that died or froze
// never returns, and ncclCommAbort is the only way out; with `blocking = 0` every call returns
// at once (possibly ncclInProgress) and this code polls ncclCommGetAsyncError and
// cudaEventQuery, sleeping briefly between polls, until the work is done, an error shows, the
// caller's interrupt fires or the deadline passes. In the last three cases the communicator is
// aborted and stays dead: the pool drops it and the next transfer creates a new one.
//
// Chunking: both ranks cut a payload into pieces of `chunk_bytes` (the last one shorter) and
// exchange one ncclSend/ncclRecv pair per piece, so the two sides must use the same chunk size
// (the transport uses kNcclChunkBytes on every node). Host payloads are staged through two
// pinned and two device buffers of at most one chunk each (double buffering: the CPU reads the
// next piece while the GPU moves the previous one), so staging memory stays bounded whatever the
// payload size. Device payloads are sent from / received into the caller's memory directly.
//
// NCCL itself is loaded at run time (transport/nccl_api.h): the first NewNcclUniqueId or
// NcclComm::Start loads it, and both answer FAILED_PRECONDITION (naming the library and why)
// where it cannot be loaded.
//
// Thread safety: NcclCommPool is thread-safe. NcclComm is thread-safe: one transfer at a time
// (a mutex per communicator serializes them); healthy(), last_used() and the accessors never
// block. Lock order: NcclCommPool::mu_ is never held while a communicator's mutex is taken.
#ifndef KVMESH_TRANSPORT_NCCL_COMM_H_
#define KVMESH_TRANSPORT_NCCL_COMM_H_

#include <nccl.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "cache/device/cuda_resources.h"
#include "cache/mutex.h"
#include "transport/nccl_api.h"
#include "transport/transport.h"

namespace kvmesh {
namespace transport {

// The piece size of the nccl transport's wire protocol: both nodes of a pair must cut payloads
// the same way, so this is a protocol constant, not a per-node setting.
inline constexpr size_t kNcclChunkBytes = size_t{64} << 20;

struct NcclCommOptions {
  int device = 0;  // CUDA ordinal the communicator's rank lives on
  // Bytes of one ncclSend/ncclRecv pair; staging buffers hold at most this much each.
  size_t chunk_bytes = kNcclChunkBytes;
  // Polling backs off from min_poll_interval to max_poll_interval while nothing changes.
  absl::Duration min_poll_interval = absl::Microseconds(5);
  absl::Duration max_poll_interval = absl::Milliseconds(1);
  // How long a graceful close (ncclCommFinalize, which waits until the peer's rank is quiescent
  // too) may take before the communicator is aborted instead, and how long an abort waits for
  // the stream to drain before it gives up on reusing the staging memory.
  absl::Duration close_timeout = absl::Seconds(5);
};

// A fresh ncclUniqueId (NCCL_UNIQUE_ID_BYTES bytes). This process hosts the bootstrap root the
// id names until every rank has joined. INTERNAL or UNAVAILABLE (no usable network interface)
// with NCCL's error; FAILED_PRECONDITION when NCCL cannot be loaded (LoadNccl).
absl::StatusOr<std::string> NewNcclUniqueId();

// Polled while a transfer or an init waits; a non-OK status stops it: the communicator is
// aborted and the status returned as it is (e.g. the peer's RPC failed first).
using NcclInterrupt = std::function<absl::Status()>;

// What a transfer sends: host bytes read chunk by chunk through a LeasedPayload, or bytes
// already in device memory on the communicator's device. Does not own what it points to.
class NcclSource {
 public:
  // REQUIRES: payload outlives the transfer.
  static NcclSource Host(LeasedPayload* payload) { return NcclSource(payload, nullptr, 0); }
  static NcclSource Device(const void* data, size_t bytes) {
    return NcclSource(nullptr, data, bytes);
  }

  size_t size() const { return payload_ != nullptr ? payload_->size() : bytes_; }
  LeasedPayload* payload() const { return payload_; }  // null for device memory
  const uint8_t* device() const { return static_cast<const uint8_t*>(device_); }

 private:
  NcclSource(LeasedPayload* payload, const void* device, size_t bytes)
      : payload_(payload), device_(device), bytes_(bytes) {}
  LeasedPayload* payload_;
  const void* device_;
  size_t bytes_;
};

// Where a transfer puts what it receives: a sink that gets the bytes in order, in host pieces
// of at most one chunk, or device memory on the communicator's device.
class NcclDestination {
 public:
  // REQUIRES: whatever `sink` refers to outlives the transfer.
  static NcclDestination Host(size_t bytes, Sink sink) { return NcclDestination(bytes, sink); }
  static NcclDestination Device(void* data, size_t bytes) { return NcclDestination(data, bytes); }

  size_t size() const { return bytes_; }
  const Sink* sink() const { return sink_ ? &*sink_ : nullptr; }  // null for device memory
  uint8_t* device() const { return static_cast<uint8_t*>(device_); }

 private:
  NcclDestination(size_t bytes, Sink sink) : bytes_(bytes), device_(nullptr) {
    sink_.emplace(sink);
  }
  NcclDestination(void* data, size_t bytes) : bytes_(bytes), device_(data) {}
  size_t bytes_;
  void* device_;
  std::optional<Sink> sink_;
};

// One rank of an NCCL communicator with its own CUDA stream.
//
// Errors of every operation: DEADLINE_EXCEEDED when the deadline passed first; UNAVAILABLE for
// a communicator that is dead (aborted, closed) or for NCCL's remote and system errors (the
// peer went away: create a new communicator and retry); INTERNAL for other NCCL or CUDA
// errors; RESOURCE_EXHAUSTED when staging memory cannot be allocated; INVALID_ARGUMENT for a
// bad peer rank or mismatched sizes (nothing is posted then, the communicator stays usable);
// ABORTED when RequestAbort stopped it; an interrupt's, a payload's or a sink's own status.
// Except for INVALID_ARGUMENT, a failed transfer or init leaves the communicator aborted
// (healthy() false): the ranks may be out of step, so it cannot be trusted again.
class NcclComm {
 public:
  // Starts initializing rank `rank` of an `nranks`-rank communicator named by `unique_id` (from
  // NewNcclUniqueId, possibly on another node) on options.device; returns at once, before the
  // other ranks have joined. `generation` is the caller's tag for this communicator (the nccl
  // transport's generation), kept as given. INVALID_ARGUMENT for a unique id of the wrong size
  // or a rank out of range; FAILED_PRECONDITION when NCCL cannot be loaded (LoadNccl).
  static absl::StatusOr<std::unique_ptr<NcclComm>> Start(absl::string_view unique_id, int nranks,
                                                         int rank, uint64_t generation,
                                                         const NcclCommOptions& options);
  // Start, then WaitReady.
  static absl::StatusOr<std::unique_ptr<NcclComm>> Create(absl::string_view unique_id, int nranks,
                                                          int rank, uint64_t generation,
                                                          const NcclCommOptions& options,
                                                          absl::Time deadline);

  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;
  // A healthy communicator is closed gracefully (Close with options.close_timeout), any other
  // one aborted. Blocks at most about options.close_timeout (twice that in the worst case).
  ~NcclComm();

  // Waits until every rank has joined and the communicator is usable. OK at once when it
  // already is.
  absl::Status WaitReady(absl::Time deadline, const NcclInterrupt& interrupt = nullptr);

  // Sends `source` to rank `peer`, which receives the same number of bytes with Recv (or
  // SendRecv). Returns when the last piece has left this rank's buffers.
  absl::Status Send(int peer, const NcclSource& source, absl::Time deadline,
                    const NcclInterrupt& interrupt = nullptr);
  // Receives destination.size() bytes from rank `peer`. Returns after the last piece has reached
  // the destination (for a sink: after the sink has taken it). A sink's error stops the transfer
  // and is returned as it is.
  absl::Status Recv(int peer, const NcclDestination& destination, absl::Time deadline,
                    const NcclInterrupt& interrupt = nullptr);
  // Sends to and receives from `peer` in the same NCCL group, piece by piece: the only way a
  // rank can exchange bytes with itself (peer == rank(), e.g. on a one-rank communicator, which
  // runs NCCL's send/receive path on a single GPU). REQUIRES: equal sizes (INVALID_ARGUMENT).
  absl::Status SendRecv(int peer, const NcclSource& source, const NcclDestination& destination,
                        absl::Time deadline, const NcclInterrupt& interrupt = nullptr);

  // Closes the communicator gracefully: ncclCommFinalize, polled until the communicator is
  // quiescent (which needs the other ranks to finalize too), then ncclCommDestroy; aborts it when
  // that fails or the deadline passes. The communicator is dead afterwards either way.
  // Idempotent: OK for one already closed, the abort's reason for one already aborted.
  absl::Status Close(absl::Time deadline);

  // Asks the communicator to abort: a transfer or init in progress stops at its next poll with
  // ABORTED and the communicator is dead; one not in use is aborted by its next operation (or its
  // destructor). Never blocks. For replacing a communicator that other threads may be using.
  void RequestAbort() { abort_requested_.store(true, std::memory_order_relaxed); }

  // False once aborted, closed or failed; initializing counts as healthy.
  bool healthy() const { return state_.load(std::memory_order_acquire) != State::kDead; }
  // True once initialized, until it dies.
  bool ready() const { return state_.load(std::memory_order_acquire) == State::kReady; }
  // Whether a transfer, init wait or close is running (or waiting for the communicator).
  bool in_use() const { return users_.load(std::memory_order_acquire) > 0; }
  // When a transfer (or the init) last finished.
  absl::Time last_used() const {
    return absl::FromUnixNanos(last_used_ns_.load(std::memory_order_relaxed));
  }
  int rank() const { return rank_; }
  int nranks() const { return nranks_; }
  int device() const { return options_.device; }
  uint64_t generation() const { return generation_; }
  const NcclCommOptions& options() const { return options_; }

 private:
  enum class State { kInitializing, kReady, kDead };
  class Use;  // counts a caller in users_ for its scope

  // Two pinned host buffers, two device buffers, of `capacity` bytes each.
  struct Staging {
    size_t capacity = 0;
    cuda::PinnedBuffer host[2];
    cuda::DeviceBuffer device[2];
  };

  NcclComm(const NcclApi* nccl, const NcclCommOptions& options, int nranks, int rank,
           uint64_t generation, cuda::Stream stream, cuda::Event done0, cuda::Event done1);

  absl::Status Transfer(const char* what, int peer, const NcclSource* source,
                        const NcclDestination* destination, absl::Time deadline,
                        const NcclInterrupt& interrupt);
  // The body of Transfer, after argument checks: any error it returns leaves the ranks out of
  // step, and the caller aborts the communicator.
  absl::Status TransferLocked(const char* what, int peer, const NcclSource* source,
                              const NcclDestination* destination, absl::Time deadline,
                              const NcclInterrupt& interrupt) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits for the piece in `slot` (if any) and hands a received one to the destination's sink.
  absl::Status FinishPieceLocked(const char* what, int slot, size_t* pending,
                                 const NcclDestination* destination, absl::Time deadline,
                                 const NcclInterrupt& interrupt) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Enqueues one piece in one NCCL group and waits until NCCL has launched it.
  absl::Status PostLocked(int peer, const void* send, void* recv, size_t bytes, absl::Time deadline,
                          const NcclInterrupt& interrupt) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Polls until `done(async error)` says so, failing on an async error, an abort request, the
  // interrupt or the deadline (each aborts the communicator). `async` is ncclSuccess or
  // ncclInProgress when `done` is called.
  absl::Status PollLocked(absl::string_view what,
                          absl::FunctionRef<absl::StatusOr<bool>(ncclResult_t async)> done,
                          absl::Time deadline, const NcclInterrupt& interrupt)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status WaitReadyLocked(absl::Time deadline, const NcclInterrupt& interrupt)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // UNAVAILABLE naming why the communicator is dead (aborting it first when an abort was
  // requested); OK while it is alive.
  absl::Status CheckAliveLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status EnsureStagingLocked(Staging* staging, size_t bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // ncclCommAbort, then lets the stream drain (bounded). Records `reason`; returns it.
  absl::Status AbortLocked(absl::Status reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CloseLocked(absl::Time deadline) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string Describe() const;
  void Touch() { last_used_ns_.store(absl::ToUnixNanos(absl::Now()), std::memory_order_relaxed); }

  const NcclApi* const nccl_;  // LoadNccl's; lives as long as the process
  const NcclCommOptions options_;
  const int nranks_;
  const int rank_;
  const uint64_t generation_;
  std::atomic<State> state_{State::kInitializing};
  std::atomic<bool> abort_requested_{false};
  std::atomic<int64_t> last_used_ns_;
  std::atomic<int> users_{0};

  Mutex mu_;
  ncclComm_t comm_ ABSL_GUARDED_BY(mu_) = nullptr;
  absl::Status dead_reason_ ABSL_GUARDED_BY(mu_);
  // Teardown order (the destructor's): the communicator, then the staging memory, the events
  // and the stream, all with the device current.
  cuda::Stream stream_ ABSL_GUARDED_BY(mu_);
  cuda::Event done_[2] ABSL_GUARDED_BY(mu_);  // completion of the piece in each slot
  Staging send_staging_ ABSL_GUARDED_BY(mu_);
  Staging recv_staging_ ABSL_GUARDED_BY(mu_);
  // Set when an aborted communicator's stream did not drain: its memory may still be in use
  // by the GPU, so the staging buffers are leaked rather than freed (cudaFree would block).
  bool stream_stuck_ ABSL_GUARDED_BY(mu_) = false;
};

// Communicators by peer key (a node pair, "self", ...): at most one per key.
class NcclCommPool {
 public:
  explicit NcclCommPool(NcclCommOptions options) : options_(std::move(options)) {}
  NcclCommPool(const NcclCommPool&) = delete;
  NcclCommPool& operator=(const NcclCommPool&) = delete;
  // Closes every communicator (each bounded by options.close_timeout).
  ~NcclCommPool();

  const NcclCommOptions& options() const { return options_; }

  // The communicator registered under `key` (possibly dead or still initializing), or null.
  std::shared_ptr<NcclComm> Find(const std::string& key) const;

  // The healthy communicator under `key`, or a new one from `create` (called without the pool's
  // lock; a dead one is dropped first). `create`'s errors are returned as they are and nothing
  // is registered. Two threads that race for a missing key may both create; the later one
  // replaces the earlier (which is asked to abort).
  absl::StatusOr<std::shared_ptr<NcclComm>> GetOrCreate(
      const std::string& key,
      absl::FunctionRef<absl::StatusOr<std::unique_ptr<NcclComm>>()> create);

  // Registers `comm` under `key`. A communicator it replaces is asked to abort
  // (RequestAbort) and is destroyed when its last user lets go of it.
  void Put(const std::string& key, std::shared_ptr<NcclComm> comm);

  // Drops `key`'s entry if it still is `comm` (e.g. after a transfer on it failed).
  void Remove(const std::string& key, const NcclComm* comm);

  // Closes and drops every communicator not used since `now - idle` (and every dead one).
  // Returns how many were dropped. Closing waits for a transfer in progress on it to end.
  size_t CloseIdle(absl::Duration idle, absl::Time now = absl::Now());

  size_t size() const;

 private:
  const NcclCommOptions options_;
  mutable Mutex mu_;
  std::map<std::string, std::shared_ptr<NcclComm>> comms_ ABSL_GUARDED_BY(mu_);
};

}  // namespace transport
}  // namespace kvmesh

#endif  // KVMESH_TRANSPORT_NCCL_COMM_H_
